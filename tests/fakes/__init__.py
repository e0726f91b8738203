"""Fakes the tests (and benchmarks/) share; they speak the real wire formats. Never part of the package.

    fakes.engine   FakeEngine: a real HTTP server in SGLang's or vLLM's wire format, outputs chosen by the test
                   (run standalone: `python tests/fakes/engine.py --port 30000 --tokens 16`)
"""
