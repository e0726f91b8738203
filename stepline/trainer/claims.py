"""The trainer's side of the pool across outages: claims and consumes that survive the pool going away.

A pool service killed (or restarted, or its database locked) while the trainer runs must not stop the
training: `Claims.claim` answers no groups while the pool is unavailable (`stepline.datapool.base.is_unavailable`;
the pool client has already retried), and `Claims.mark_consumed` reports False and the caller keeps the
group ids to send again (the checkpoint on disk holds them too; marking a consumed group again is a no-op).

The one thing an outage can hide is a claim the pool committed but whose answer never arrived (the
service died between its commit and its reply; a claim is never re-sent): the pool holds that group as
claimed by us, and nothing would ever train or release it. So after an outage the first thing sent is
`release_unknown`: every group the pool says we hold and we do not know of goes back to the pool, and
is claimed again, by us or another trainer. The same rule settles a restart (`stepline.trainer.loop.resume`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from stepline.datapool.base import Pool, is_unavailable
from stepline.datapool.records import Group, LeafRule

__all__ = ["Claims", "release_unknown"]

log = logging.getLogger(__name__)


def release_unknown(pool: Pool, consumer: str, known: Collection[str]) -> list[str]:
    """Release the groups the pool handed to `consumer` that are not in `known`; returns their ids."""
    lost = [g for g in pool.claimed_groups(consumer) if g not in known]
    if lost:
        pool.release_groups(lost, consumer)
    return lost


class Claims:
    """Claim and mark groups for one consumer, riding out pool outages (see the module docstring)."""

    def __init__(self, pool: Pool, consumer: str) -> None:
        self.pool = pool
        self.consumer = consumer
        self.outages = 0  # pool calls that failed as unavailable
        self._unsure = False  # an outage happened since the last settled state: a claim may be unknown

    def claim(self, known: Collection[str], min_version: int, max_groups: int, group_size: int | None,
              leaf_rule: LeafRule) -> list[Group]:
        """Ready groups, or [] while the pool is unavailable. `known`: the group ids this trainer holds
        (pending or consumed), which a settlement after an outage must not release."""
        try:
            if self._unsure:
                if lost := release_unknown(self.pool, self.consumer, known):
                    log.warning("released %d groups claimed during a pool outage whose answer was lost", len(lost))
                self._unsure = False
            return self.pool.claim_groups(self.consumer, min_version=min_version, max_groups=max_groups,
                                          group_size=group_size, leaf_rule=leaf_rule)
        except Exception as exc:
            if not is_unavailable(exc):  # a refusal or a bug: not ours to hide
                raise
            self._outage(exc, "claim")
            return []

    def mark_consumed(self, group_ids: list[str]) -> bool:
        """Tell the pool these groups are consumed; False while it is unavailable (send them again later)."""
        try:
            self.pool.mark_consumed(group_ids, self.consumer)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            self._outage(exc, f"mark {len(group_ids)} groups consumed")
            return False
        return True

    def _outage(self, exc: Exception, what: str) -> None:
        self.outages += 1
        self._unsure = True
        log.warning("pool unavailable (%s: %r); the trainer waits and tries again", what, exc)
