"""The trainer (docs/reference.md, Trainer).

Importing the package tells OpenMP to sleep rather than spin while a parallel region waits for its
threads (OMP_WAIT_POLICY=PASSIVE, unless the environment already chose). libgomp reads the variable
once, when torch loads it, so it is set here: `stepline train` and `stepline run` import this package
before torch. On the 2-core machine shared with the engine and the harnesses, spinning threads burn
the cores the other thread waits for: an SFT step of SmolLM2-135M took 8-14 s with the default policy
and 2.5-4.8 s with this one, same process, same rows (benchmarks/bench_trainer.py --model).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
