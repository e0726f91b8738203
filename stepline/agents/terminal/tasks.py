"""The terminal task set: short, regular shell chores on one or two files.

Every task is one of a few kinds with fixed phrasing, applied to a file name (the entity) and a
variant. Tasks are deterministic functions of their id, ``"<kind>-<name>-<variant>"``; the
train/test split is by entity (every fifth name is held out), so test tasks use file names that
never appear in training. Each kind has a setup (files written before the episode), an expert
command (one line, used for demonstrations and to prove each task solvable) and a check that
reads only the sandbox directory after the episode.

    python -m stepline.agents.terminal.tasks --split train|test     # JSON list of task ids
"""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stepline.agents.common import tasks_command

NAMES = (
    "ant bear bird cat cow crab deer dog duck eel elk fig fish fox frog goat hen jam kiwi lamb "
    "lime lion mole moth mule newt owl pear pig plum ram rat seal slug swan toad wolf yak bee emu"
).split()
WORDS = "red blue green black white pink gray gold".split()
VARIANTS = 2
TEST_EVERY = 5  # names[i] with i % TEST_EVERY == TEST_EVERY - 1 are test entities
MAX_READ = 64 * 1024


@dataclass(frozen=True)
class Task:
    task_id: str
    kind: str
    name: str  # file stem, the entity of the split
    word: str  # a colour chosen by the variant
    number: int  # a small count chosen by the variant (2..9)

    @property
    def prompt(self) -> str:
        return KINDS[self.kind].prompt.format(n=self.name, w=self.word)

    @property
    def expert_command(self) -> str:
        return KINDS[self.kind].expert.format(n=self.name, w=self.word)

    def lines(self) -> list[str]:
        """The colour lines of this task's input file (deterministic; `word` on every other line)."""
        others = [w for w in WORDS if w != self.word]
        seed = zlib.crc32(self.task_id.encode())
        return [self.word if i % 2 == 0 else others[(seed + i) % len(others)] for i in range(self.number)]


@dataclass(frozen=True)
class Kind:
    prompt: str  # {n}: name, {w}: word
    expert: str
    setup: Callable[[Task], dict[str, str]]  # relative path -> content
    check: Callable[[Task, Path], str | None]  # None = success, else the reason it failed


def _input_file(t: Task) -> dict[str, str]:
    return {f"{t.name}.txt": "\n".join(t.lines()) + "\n"}


def _none(t: Task) -> dict[str, str]:
    return {}


def read_file(root: Path, rel: str) -> str | None:
    """Text of a regular file inside root (no symlinks followed, size capped), or None."""
    try:
        fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(MAX_READ).decode("utf-8", errors="replace")


def _expect(rel: str, want: str) -> Callable[[Task, Path], str | None]:
    """Check that file `rel` holds `want` (both formatted with the task; trailing spaces ignored)."""

    def check(t: Task, root: Path) -> str | None:
        path, expected = rel.format(n=t.name, w=t.word), want.format(n=t.name, w=t.word)
        got = read_file(root, path)
        if got is None:
            return f"{path} missing"
        return None if got.strip() == expected.strip() else f"{path} holds {got[:40]!r}, want {expected[:40]!r}"

    return check


def _check_count(t: Task, root: Path) -> str | None:
    return _expect("count.txt", str(t.number))(t, root)


def _check_copy(t: Task, root: Path) -> str | None:
    want = "\n".join(t.lines())
    return _expect(f"{t.name}.txt", want)(t, root) or _expect("backup.txt", want)(t, root)


def _check_move(t: Task, root: Path) -> str | None:
    if (root / f"{t.name}.txt").exists():
        return f"{t.name}.txt still exists"
    return _expect(f"{t.word}.txt", "\n".join(t.lines()))(t, root)


def _check_delete(t: Task, root: Path) -> str | None:
    if (root / f"{t.name}.txt").exists() or (root / f"{t.name}.txt").is_symlink():
        return f"{t.name}.txt still exists"
    return _expect("keep.txt", "{w}")(t, root)


def _check_mkdir(t: Task, root: Path) -> str | None:
    path = root / t.name
    return None if path.is_dir() and not path.is_symlink() else f"no directory {t.name}"


def _grep_check(t: Task, root: Path) -> str | None:
    return _expect("found.txt", "\n".join(line for line in t.lines() if t.word in line))(t, root)


def _sort_check(t: Task, root: Path) -> str | None:
    return _expect("sorted.txt", "\n".join(sorted(t.lines())))(t, root)


def _head_check(t: Task, root: Path) -> str | None:
    return _expect("first.txt", t.lines()[0])(t, root)


KINDS: dict[str, Kind] = {
    "write": Kind("Write {w} to {n}.txt.", "echo {w} > {n}.txt", _none, _expect("{n}.txt", "{w}")),
    "mkdir": Kind("Make a directory named {n}.", "mkdir {n}", _none, _check_mkdir),
    "delete": Kind(
        "Delete {n}.txt.", "rm {n}.txt",
        lambda t: {f"{t.name}.txt": f"{t.word}\n", "keep.txt": f"{t.word}\n"}, _check_delete,
    ),
    "copy": Kind("Copy {n}.txt to backup.txt.", "cp {n}.txt backup.txt", _input_file, _check_copy),
    "move": Kind("Rename {n}.txt to {w}.txt.", "mv {n}.txt {w}.txt", _input_file, _check_move),
    "count": Kind("Count the lines of {n}.txt into count.txt.", "wc -l < {n}.txt > count.txt", _input_file, _check_count),
    "grep": Kind("Save the lines of {n}.txt with {w} to found.txt.", "grep {w} {n}.txt > found.txt", _input_file, _grep_check),
    "sort": Kind("Sort {n}.txt into sorted.txt.", "sort {n}.txt > sorted.txt", _input_file, _sort_check),
    "head": Kind("Save the first line of {n}.txt to first.txt.", "head -n 1 {n}.txt > first.txt", _input_file, _head_check),
}


class UnknownTask(ValueError):
    """The id does not name a task of this set."""


def get_task(task_id: str) -> Task:
    kind, _, rest = task_id.partition("-")
    name, _, variant = rest.partition("-")
    if kind not in KINDS or name not in NAMES or variant not in {str(v) for v in range(VARIANTS)}:
        raise UnknownTask(f"unknown terminal task {task_id!r} (want <kind>-<name>-<variant>)")
    seed = zlib.crc32(task_id.encode())
    return Task(task_id, kind, name, WORDS[seed % len(WORDS)], 2 + (seed >> 8) % 8)


def is_task(task_id: str) -> bool:
    try:
        get_task(task_id)
    except UnknownTask:
        return False
    return True


def task_ids(split: str) -> list[str]:
    """All task ids of a split, in a fixed order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, not {split!r}")
    want_test = split == "test"
    return [
        f"{kind}-{name}-{v}"
        for i, name in enumerate(NAMES)
        if (i % TEST_EVERY == TEST_EVERY - 1) == want_test
        for kind in KINDS
        for v in range(VARIANTS)
    ]


def setup(task: Task, root: Path) -> None:
    """Write the task's input files into the (empty) sandbox directory."""
    for rel, content in KINDS[task.kind].setup(task).items():
        (root / rel).write_text(content)


def check(task: Task, root: Path) -> str | None:
    """None when the sandbox holds what the task asked for, else the reason it does not."""
    return KINDS[task.kind].check(task, root)


main = tasks_command(task_ids)

if __name__ == "__main__":
    main()
