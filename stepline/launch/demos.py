"""Expert demonstrations for the SFT warm start.

Each harness's `--expert` mode plays a scripted solver through the same tools and writes the
conversation it would have had with a model (`episode.json`: `messages` and `tools`, in the harness's
own API format). Here those conversations become pool sessions, token for token as the gateway would
have recorded them (`stepline.gateway.demonstrations.records_from_conversation`).
The sessions are ended and rewarded by the harness's verifier, so the trainer's SFT mode takes them as
ordinary groups.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Mapping
from itertools import zip_longest
from pathlib import Path

from stepline.datapool.base import Pool
from stepline.datapool.records import Reward, SessionInfo
from stepline.gateway.demonstrations import records_from_conversation
from stepline.gateway.templating import ChatTemplate
from stepline.rollout.config import HarnessSpec
from stepline.rollout.demos import expert_episodes

__all__ = ["collect_demos"]

def collect_demos(pool: Pool, model_dir: Path, specs: list[HarnessSpec], per_harness: int,
                  concurrency: int = 2, seed: int = 0, counts: Mapping[str, int] | None = None,
                  matching: Mapping[str, str] | None = None,
                  kinds: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, int]:
    """Run `per_harness` expert episodes of each module harness (`counts[name]` where given; a seeded sample
    of its train split, of the ids matching `matching[name]` where given, weighted by kind as `kinds[name]`
    says) into `pool` as ended, rewarded sessions (one group each). Returns demonstrations written per harness."""
    template = ChatTemplate.from_model_dir(model_dir)
    written = {spec.name: 0 for spec in specs}
    with tempfile.TemporaryDirectory(prefix="stepline-demos-") as tmp:
        results = asyncio.run(expert_episodes([s for s in specs if s.module], per_harness, concurrency, Path(tmp), seed,
                                              counts, matching, kinds))
    # round-robin over harnesses, so every SFT minibatch mixes them (the pool hands groups out in order)
    by_harness = [[r for r in results if r[0].name == spec.name] for spec in specs]
    interleaved = [row for rows in zip_longest(*by_harness) for row in rows if row is not None]
    for spec, task_id, result in interleaved:
        if result is None:
            continue
        episode, reward = result
        session_id = f"demo-{spec.name}-{task_id}-{uuid.uuid4().hex[:8]}"
        pool.create_session(SessionInfo(session_id=session_id, task_id=task_id, harness=spec.name,
                                        group_id=session_id, created_at=time.time(), purpose="demo"))
        pool.add_calls(records_from_conversation(template, episode, session_id))
        pool.add_reward(Reward(session_id=session_id, value=reward, created_at=time.time()))
        pool.end_session(session_id, "completed")
        written[spec.name] += 1
    return written
