"""Hindsight relabelling (Hindsight Experience Replay, arXiv 1707.01495): the instruction a failed episode did carry
out.

An episode that tapped the switch above the one asked for did not fail at everything: it turned that switch on,
reading the screen as the expert does. Under the instruction that names what it did ("Turn on Wi-Fi.") it is a
correct demonstration of the decision the task asked for: where to stop reading and act. `achieved` names that
instruction where one change of a kind the world's tasks make describes the whole difference between the start and
the end (the same sentence a task of that kind would have), else None.
"""

from __future__ import annotations

from typing import Any

from stepline.agents.ui.world import (
    Task,
    add_alarm_text,
    alarm_text,
    buy_text,
    delete_text,
    favorite_text,
    toggle_text,
)


def achieved(task: Task, data: dict[str, Any]) -> str | None:
    """The instruction of a task from `task`'s start whose goal state is `data` (None where no one task is)."""
    return _DESCRIBE[task.app](task.data, data)


def _settings(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    if start["sections"] != end["sections"]:
        return None
    flipped = [t for t, on in end["toggles"].items() if start["toggles"].get(t) != on]
    return toggle_text(flipped[0], end["toggles"][flipped[0]]) if len(flipped) == 1 else None


def _alarms(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    before = {a["time"]: a["on"] for a in start["alarms"]}
    after = {a["time"]: a["on"] for a in end["alarms"]}
    added = [t for t in after if t not in before]
    if before.keys() <= after.keys() and len(added) == 1 and after[added[0]] and all(after[t] == on for t, on in before.items()):
        return add_alarm_text(added[0])
    flipped = [t for t, on in after.items() if before.get(t) != on]
    return alarm_text(flipped[0], after[flipped[0]]) if before.keys() == after.keys() and len(flipped) == 1 else None


def _contacts(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    before = {c["name"]: c for c in start["contacts"]}
    after = {c["name"]: c for c in end["contacts"]}
    gone = [name for name in before if name not in after]
    if after.keys() <= before.keys() and len(gone) == 1 and all(after[n] == before[n] for n in after):
        return delete_text(gone[0])
    changed = [name for name in after if after[name] != before.get(name)]
    if before.keys() != after.keys() or len(changed) != 1:
        return None
    name = changed[0]
    favorited = before[name] | {"favorite": True}
    return favorite_text(name) if not before[name]["favorite"] and after[name] == favorited else None


def _shopping(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    if start["products"] != end["products"]:
        return None
    cart, grown = start["cart"], end["cart"]
    changed = [p for p in grown.keys() | cart.keys() if grown.get(p, 0) != cart.get(p, 0)]
    if len(changed) != 1 or (added := grown.get(changed[0], 0) - cart.get(changed[0], 0)) < 1:
        return None
    return buy_text(changed[0], added)


_DESCRIBE = {"settings": _settings, "alarms": _alarms, "contacts": _contacts, "shopping": _shopping}
