"""Fork links in the pool: metadata.fork_of is checked, read back as SessionInfo.fork_of, and shown in the
tree view (`stepline pool show`) on both sides: the fork names its source, the source shows the fork at
the state it branched from."""

from __future__ import annotations

import pytest
from pool_helpers import call
from rich.console import Console

from stepline.datapool import InvalidRecord, open_pool
from stepline.datapool.records import ForkPoint, SessionInfo
from stepline.datapool.show import render_episode


def text(renderable) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_fork_links_are_kept_checked_and_shown(tmp_path) -> None:
    pool = open_pool(f"sqlite:///{tmp_path}/pool.db")
    try:
        pool.create_session(SessionInfo("src", "t", "h"))
        pool.create_session(SessionInfo("fork", "t", "h", metadata={"fork_of": {"session": "src", "call": 1}}))
        for bad in ({"session": "src"}, {"session": "src", "call": -1}, {"session": "", "call": 0}, "src"):
            with pytest.raises(InvalidRecord, match="fork_of"):
                pool.create_session(SessionInfo("bad", "t", "h", metadata={"fork_of": bad}))
        # the source: calls 0 and 1; the fork's first recorded call is 1, its prompt the source's prompt at 1
        pool.add_calls([call("src", 0, [1, 2], [3, 4]), call("src", 1, [1, 2, 3, 4, 5], [6])])
        pool.add_calls([call("fork", 1, [1, 2, 3, 4, 5], [7])])
        assert pool.get_session("fork").fork_of == ForkPoint("src", 1)
        assert pool.get_session("src").fork_of is None
        assert sorted(pool.get_tree("fork").calls) == [1]
        source_view = text(render_episode(pool.get_episode("src"), forks=[pool.get_session("fork")]))
        fork_view = text(render_episode(pool.get_episode("fork")))
    finally:
        pool.close()
    assert "fork of src at call 1" in fork_view
    lines = source_view.splitlines()
    at = next(i for i, line in enumerate(lines) if "⑂ fork fork" in line)
    assert "obs" in lines[at - 1] and "call 1" in lines[at - 1]  # below the node where call 1's prompt ends
