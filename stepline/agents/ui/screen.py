"""Simulated apps: a navigation stack of screens, each a list of accessibility nodes.

A screen renders as one line per visible node, e.g.

    Alarms
    [1] switch 06:45: on
    [2] switch 07:30: off
    (more below)
    [4] field New alarm:
    [5] button Add

Node ids number every node of the screen in order, scrolled-out list items included, so an id stays
valid while scrolling but only visible nodes can be tapped. An app subclass writes `nodes(screen)`
(the nodes of a screen name) and `activate(node)` (what a tap does); everything else lives here.
Invalid actions raise `ToolError` before changing anything, so replaying an episode's calls
reproduces its final state exactly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from stepline.agents.common import ToolError

Key = tuple[str, ...]  # what a node stands for inside the app, e.g. ("toggle", "Wi-Fi")


@dataclass(frozen=True)
class Node:
    role: str  # button | switch | field | text
    label: str
    value: str | None = None
    key: Key = ()
    item: bool = False  # part of the screen's scrollable list


class App:
    """Base app. Subclasses set `title` and `visible_items`, and write `nodes` and `activate`."""

    title = "App"
    visible_items = 4

    def __init__(self, data: dict[str, Any]):
        self.data = copy.deepcopy(data)  # what the task scores
        self.stack = ["home"]  # screen names; the top is shown
        self.offset = 0  # first visible list item
        self.fields: dict[Key, str] = {}  # text typed into fields, by node key

    # -- written by subclasses -------------------------------------------------------------------
    def nodes(self, screen: str) -> list[Node]:
        raise NotImplementedError

    def activate(self, node: Node) -> None:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    def open(self, screen: str) -> None:
        self.stack.append(screen)
        self.offset = 0

    def close(self) -> None:
        self.stack.pop()
        self.offset = 0

    def _window(self) -> list[tuple[int, Node | None]]:
        """(id, node) of the visible nodes in order; (0, None) marks hidden list items."""
        nodes = self.nodes(self.stack[-1])
        n_items = sum(node.item for node in nodes)
        shown, index = range(self.offset, self.offset + self.visible_items), 0
        out: list[tuple[int, Node | None]] = []
        for node_id, node in enumerate(nodes, start=1):
            if node.item:
                if index == self.offset and self.offset > 0:
                    out.append((0, None))  # "(more above)"
                if index in shown:
                    out.append((node_id, node))
                if index == self.offset + self.visible_items and index < n_items:
                    out.append((-1, None))  # "(more below)"
                index += 1
            else:
                out.append((node_id, node))
        return out

    def render(self) -> str:
        lines = [self.title if self.stack[-1] == "home" else self.stack[-1].split(":", 1)[-1]]
        for node_id, node in self._window():
            if node is None:
                lines.append("(more above)" if node_id == 0 else "(more below)")
            else:
                value = f": {node.value}" if node.value is not None else ""
                lines.append(f"[{node_id}] {node.role} {node.label}{value}")
        return "\n".join(lines)

    def _visible(self, node_id: Any) -> Node:
        try:
            wanted = int(node_id)
        except (TypeError, ValueError):
            raise ToolError(f"id must be a number, not {node_id!r}") from None
        for shown_id, node in self._window():
            if node is not None and shown_id == wanted:
                return node
        raise ToolError(f"no element {wanted} on screen")

    def tap(self, id: Any) -> str:  # noqa: A002 (the tool's argument name)
        node = self._visible(id)
        if node.role not in ("button", "switch"):
            raise ToolError(f"element {id} is a {node.role}, not tappable")
        self.activate(node)
        return self.render()

    def type(self, id: Any, text: Any) -> str:  # noqa: A002
        node = self._visible(id)
        if node.role != "field":
            raise ToolError(f"element {id} is a {node.role}, not a field")
        self.fields[node.key] = str(text)[:40]
        return self.render()

    def scroll(self, direction: Any) -> str:
        n_items = sum(node.item for node in self.nodes(self.stack[-1]))
        last = max(0, n_items - self.visible_items)
        if direction == "down":
            self.offset = min(self.offset + self.visible_items, last)
        elif direction == "up":
            self.offset = max(0, self.offset - self.visible_items)
        else:
            raise ToolError("direction must be up or down")
        return self.render()

    def back(self) -> str:
        if len(self.stack) == 1:
            raise ToolError("already on the first screen")
        self.close()
        return self.render()
