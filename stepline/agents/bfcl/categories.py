"""The BFCL categories the harness covers, their leaderboard names, and the fixed train/test split.

Task ids are BFCL's own (`simple_python_12`, `live_multiple_3-1-0`, `multi_turn_base_7`); a task's category
is its id up to the last "_" (as bfcl_eval.utils.extract_test_category_from_id reads it).
"""

from __future__ import annotations

import hashlib

# category -> the leaderboard's column for it (bfcl_eval/constants/column_headers.py, section first)
METRICS = {
    "simple_python": "Non-Live Python Simple AST",
    "multiple": "Non-Live Multiple AST",
    "parallel": "Non-Live Parallel AST",
    "parallel_multiple": "Non-Live Parallel Multiple AST",
    "live_simple": "Live Python Simple AST",
    "live_multiple": "Live Python Multiple AST",
    "live_parallel": "Live Python Parallel AST",
    "live_parallel_multiple": "Live Python Parallel Multiple AST",
    "multi_turn_base": "Multi Turn Base",
}
CATEGORIES = tuple(METRICS)
TEST_SHARE = 5  # one task in five is held out: the test split, never an SFT demonstration or an RL episode


def category_of(task_id: str) -> str:
    return task_id.rsplit("_", 1)[0]


def is_multi_turn(task_id: str) -> bool:
    return category_of(task_id).startswith("multi_turn")


def split_of(task_id: str) -> str:
    """"test" for the tasks whose SHA-256 of the id is 0 mod TEST_SHARE: fixed whatever order or subset of
    the data a release ships, and about a fifth of every category."""
    digest = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big")
    return "test" if digest % TEST_SHARE == 0 else "train"
