"""What one episode came to (`EpisodeResult`) and the counts per harness (`HarnessStats`): the records the
rollout driver (driver.py) and the tree groups (trees.py) hand back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EpisodeResult", "HarnessStats"]


@dataclass
class EpisodeResult:
    harness: str
    task_id: str
    session_id: str | None  # None when no session could be opened
    status: Literal["completed", "failed"]
    reward: float | None  # None: the harness posts its own (no verifier)
    success: bool
    reason: str
    attempt: int = 0  # 0 for the first try, 1.. for retries of a failed episode
    seconds: float = 0.0


@dataclass
class HarnessStats:
    episodes: int = 0
    successes: int = 0
    failed: int = 0
    reward_sum: float = 0.0
    rewarded: int = 0  # episodes whose reward the driver knows

    def add(self, result: EpisodeResult) -> None:
        self.episodes += 1
        self.successes += result.success
        self.failed += result.status == "failed"
        if result.reward is not None:
            self.reward_sum += result.reward
            self.rewarded += 1

    def summary(self, elapsed_s: float) -> dict[str, float]:
        return {
            "episodes": self.episodes, "failed": self.failed,
            "success_rate": self.successes / self.episodes if self.episodes else 0.0,
            "mean_reward": self.reward_sum / self.rewarded if self.rewarded else 0.0,
            "episodes_per_s": self.episodes / elapsed_s if elapsed_s > 0 else 0.0,
        }
