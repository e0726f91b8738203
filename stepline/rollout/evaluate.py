"""Evaluation: the test split of every harness in a job, through the current policy at the gateway
(`stepline eval JOB.toml --gateway URL`, stepline/launch/commands.py; `stepline run` before and after RL).

Each test task runs once (at `--temperature` where given, which the gateway applies to every call of the
session whatever the harness asks; else at the job's [rollout] temperature or the harness's own) in a session of purpose "eval"
(`SessionInfo.purpose`) with metadata {"split": "test"} and an explicit group id "eval::<task>::<harness>::…",
so a trainer leaves these sessions out. Prints success per harness and writes the report as JSON.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import httpx

from stepline.rollout.client import GatewayClient
from stepline.rollout.config import RolloutConfig, list_tasks
from stepline.rollout.driver import RolloutDriver, results_json

__all__ = ["evaluate", "spread"]


async def evaluate(config: RolloutConfig, gateway_url: str, admin_token: str | None = None, split: str = "test",
                   limit: int | None = None, temperature: float | None = None) -> dict[str, Any]:
    """Run `split` of every harness once per task (at `temperature`, else the rollouts'); {"split",
    "temperature", "weight_version", "harnesses": {name: stats}, "episodes": [...]}."""
    update: dict[str, Any] = {"retries": 0} if temperature is None else {"retries": 0, "temperature": temperature}
    config = config.model_copy(update=update)
    tasks = await asyncio.to_thread(lambda: {h.name: spread(list_tasks(h, split), limit) for h in config.harnesses})
    with tempfile.TemporaryDirectory(prefix="stepline-eval-", dir=config.work_dir) as work:
        async with (GatewayClient(gateway_url, admin_token) as gateway,
                    RolloutDriver(config, gateway, Path(work), purpose="eval") as driver):
            await asyncio.gather(*(
                driver.run_group(spec, task_id, group_size=1, metadata={"split": split}, prefix="eval::")
                for spec in config.harnesses for task_id in tasks[spec.name]
            ))
    return {"split": split, "temperature": config.temperature, "weight_version": await _weight_version(gateway_url),
            "harnesses": driver.summary(), "episodes": results_json(driver.results)}


def spread(task_ids: list[str], limit: int | None) -> list[str]:
    """`limit` tasks evenly spaced over the list (all when None): task lists are ordered by kind and
    entity, so the first `limit` would test only the first kinds."""
    if limit is None or limit >= len(task_ids):
        return task_ids
    return [task_ids[i * len(task_ids) // limit] for i in range(limit)]


async def _weight_version(gateway_url: str) -> int | None:
    """The policy version the gateway serves now (None if /health does not say)."""
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            return (await http.get(f"{gateway_url.rstrip('/')}/health")).json().get("weight_version")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
