"""The job's rollout thread: stopping it after it already finished on its own is not an error."""

from __future__ import annotations

from pathlib import Path

from stepline.datapool import open_pool
from stepline.rollout.config import RolloutConfig
from stepline.rollout.pacing import BackgroundRollouts, Pacing


def test_stop_after_the_rollouts_ran_out(tmp_path: Path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path / 'pool.db'}")
    try:
        # max_batches = 0: the thread ends at once and its event loop closes, as after the last batch of a job
        rollouts = BackgroundRollouts(RolloutConfig(), "http://127.0.0.1:9", "token", tmp_path / "episodes", pool,
                                      Pacing(batch_groups=1, ahead=1, max_batches=0))
        rollouts.start()
        rollouts._thread.join(30)
        assert not rollouts._thread.is_alive() and rollouts.error is None
        rollouts.stop()  # raised "Event loop is closed" and failed a finished job
        assert rollouts.history == []
    finally:
        pool.close()
