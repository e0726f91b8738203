"""Export / import: a lossless round trip, read-only export files, refused bad files; the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner
from pool_helpers import call, session

from stepline.datapool import PoolError, ReadOnlyPool, open_pool
from stepline.datapool.cli import pool_group
from stepline.datapool.export import export_pool, import_pool, read_export
from stepline.datapool.records import Reward


def fill(pool) -> None:
    pool.create_session(session("a", group="g"))
    pool.create_session(session("b"))
    pool.create_session(session("c"))
    pool.add_calls([call("a", 0, [1, 2, 3], [4, 5], request=b"\x28req", response=b"resp",
                         sampling={"temperature": 0.7}, timings={"done": 1.5}),
                    call("a", 1, [1, 2, 3], [4, 6], version=1),  # a retry
                    call("a", 2, [1, 2, 3, 4, 6, 7], [8], version=2, finish_reason="length"),
                    call("b", 0, [9], [9, 9])])
    pool.add_reward(Reward("a", 1.0, created_at=5.0))
    pool.add_reward(Reward("a", 0.5, step=2, name="tool", weight=0.1, created_at=6.0))
    pool.add_reward(Reward("b", 0.0, created_at=7.0))
    for s in ("a", "b"):
        pool.end_session(s)
    [group] = pool.claim_groups("trainer", 0, 1)
    pool.mark_consumed([group.group_id], "trainer")


def body(path):
    return list(read_export(path))


def test_round_trip_loses_nothing(tmp_path, db_url):
    src = open_pool(db_url)
    fill(src)
    counts = export_pool(src, tmp_path / "one.pool")
    assert counts == {"sessions": 3, "calls": 4, "rewards": 3, "groups": 1}
    dst = open_pool(f"sqlite:///{tmp_path}/copy.db")
    assert import_pool(tmp_path / "one.pool", dst) == counts
    export_pool(dst, tmp_path / "two.pool")
    first, second = body(tmp_path / "one.pool"), body(tmp_path / "two.pool")
    assert len(first) == len(second) == 3 + 4 + 3 + 1 + 1
    for a, b in zip(first, second, strict=True):  # record by record, arrays compared by value
        assert a.keys() == b.keys()
        for k in a:
            same = np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
            assert same, (k, a[k], b[k])
    for s in ("a", "b", "c"):
        assert dst.get_session(s) == src.get_session(s)
        ga, gb = src.get_calls(s), dst.get_calls(s)
        assert [(x.prompt_ids.tolist(), x.request, x.timings) for x in ga] == \
            [(x.prompt_ids.tolist(), x.request, x.timings) for x in gb]
    assert dst.stats() == src.stats()
    assert dst.claim_groups("t", 0, 5) == []  # the consumed group stayed consumed; c is still open
    src.close()
    dst.close()


def test_export_file_opens_read_only_in_memory(tmp_path):
    src = open_pool(f"sqlite:///{tmp_path}/a.db")
    fill(src)
    src.end_session("c")
    src.add_reward(Reward("c", 1.0))
    export_pool(src, tmp_path / "x.pool")
    pool = open_pool(str(tmp_path / "x.pool"))
    with pytest.raises(ReadOnlyPool):
        pool.add_reward(Reward("a", 1.0))
    [group] = pool.claim_groups("offline", 0, 5)  # claims on an export live in memory only
    assert [e.info.session_id for e in group.episodes] == ["b", "c"]  # a was consumed before the export
    [main] = pool.get_episode("a", "main").trajectories
    assert main.tokens.tolist() == [1, 2, 3, 4, 6, 7, 8]


def test_a_database_path_opens_as_that_sqlite_pool(tmp_path, monkeypatch):
    # `stepline run` prints the pool as a path (run_dir/pool.db); `pool show --db <that path>` must read it
    src = open_pool(f"sqlite:///{tmp_path}/a.db")
    fill(src)
    src.close()
    monkeypatch.chdir(tmp_path)
    for path in (str(tmp_path / "a.db"), "a.db"):
        pool = open_pool(path, read_only=True)
        assert {s.session_id for s in pool.list_sessions()} == {"a", "b", "c"}
        with pytest.raises(ReadOnlyPool):
            pool.add_reward(Reward("a", 1.0))
        pool.close()


def test_import_refuses_bad_files_and_existing_sessions(tmp_path):
    src = open_pool(f"sqlite:///{tmp_path}/a.db")
    fill(src)
    export_pool(src, tmp_path / "x.pool")
    with pytest.raises(PoolError, match="already exists"):
        import_pool(tmp_path / "x.pool", src)
    assert src.stats()["sessions"] == 3  # nothing partial
    raw = zstandard.ZstdDecompressor().stream_reader(open(tmp_path / "x.pool", "rb")).read()
    (tmp_path / "cut.pool").write_bytes(zstandard.ZstdCompressor().compress(raw[: len(raw) // 2]))
    (tmp_path / "junk.pool").write_bytes(b"not a pool")
    fresh = open_pool(f"sqlite:///{tmp_path}/b.db")
    for bad, match in (("cut.pool", "truncated|corrupt"), ("junk.pool", "not a Stepline pool export")):
        with pytest.raises(PoolError, match=match):
            import_pool(tmp_path / bad, fresh)
    assert fresh.stats()["sessions"] == 0


def test_cli_export_import_show(tmp_path):
    db = f"sqlite:///{tmp_path}/a.db"
    pool = open_pool(db)
    fill(pool)
    pool.close()
    runner = CliRunner(env={"COLUMNS": "200"})
    out = runner.invoke(pool_group, ["export", db, str(tmp_path / "x.pool")])
    assert out.exit_code == 0, out.output
    assert "exported 3 sessions, 4 calls, 3 rewards, 1 groups" in out.output
    out = runner.invoke(pool_group, ["import", str(tmp_path / "x.pool"), f"sqlite:///{tmp_path}/b.db"])
    assert out.exit_code == 0 and "imported 3 sessions" in out.output, out.output
    out = runner.invoke(pool_group, ["show", "a", "--db", f"sqlite:///{tmp_path}/b.db"])
    assert out.exit_code == 0, out.output
    assert "dead (superseded)" in out.output and "main" in out.output and "reward tool=0.5" in out.output
    assert "act #" in out.output and "v2" in out.output
    out = runner.invoke(pool_group, ["show", "zz", "--db", db])
    assert out.exit_code != 0 and "unknown session 'zz'" in out.output
    out = runner.invoke(pool_group, ["export", "http://127.0.0.1:1", str(tmp_path / "y.pool")])
    assert out.exit_code != 0 and "not the service" in out.output


def test_show_decodes_with_a_tokenizer(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    db = f"sqlite:///{tmp_path}/a.db"
    pool = open_pool(db)
    pool.create_session(session("a"))
    pool.add_calls([call("a", 0, tok.encode("hello there"), tok.encode("general kenobi"))])
    pool.close()
    args = ["show", "a", "--db", db, "--tokenizer", str(tiny_model_dir)]
    out = CliRunner(env={"COLUMNS": "200"}).invoke(pool_group, args)
    assert out.exit_code == 0, out.output
    assert "hello there" in out.output and "general kenobi" in out.output
