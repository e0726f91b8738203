"""The four simulated apps: settings, alarms, contacts, shopping.

Each app's `data` (the part a task scores) is plain JSON:
    settings: {"sections": [section names in screen order], "toggles": {name: bool}}
    alarms:   {"alarms": [{"time": "HH:MM", "on": bool}, ...]}   (sorted by time)
    contacts: {"contacts": [{"name", "phone", "favorite"}, ...]}  (sorted by name)
    shopping: {"products": [name, ...], "cart": {name: quantity}}
"""

from __future__ import annotations

import re

from stepline.agents.common import ToolError
from stepline.agents.ui.screen import App, Node

SECTIONS = {
    "Network": ("Wi-Fi", "Bluetooth", "Airplane mode", "Hotspot"),
    "Display": ("Dark mode", "Auto rotate", "Night light"),
    "Sound": ("Vibrate", "Do not disturb", "Silent mode"),
}
TIME = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")
MAX_QUANTITY = 20


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


class SettingsApp(App):
    title = "Settings"

    def nodes(self, screen: str) -> list[Node]:
        if screen == "home":
            return [Node("button", name, key=("open", name)) for name in self.data["sections"]]
        section = screen.split(":", 1)[1]
        return [Node("switch", t, on_off(self.data["toggles"][t]), ("toggle", t)) for t in SECTIONS[section]]

    def activate(self, node: Node) -> None:
        kind, name = node.key
        if kind == "open":
            self.open(f"section:{name}")
        else:
            self.data["toggles"][name] = not self.data["toggles"][name]


class AlarmsApp(App):
    title = "Alarms"
    visible_items = 3

    def nodes(self, screen: str) -> list[Node]:
        alarms = [Node("switch", a["time"], on_off(a["on"]), ("alarm", a["time"]), item=True) for a in self.data["alarms"]]
        return [*alarms, Node("field", "New alarm", self.fields.get(("new",), ""), ("new",)), Node("button", "Add", key=("add",))]

    def activate(self, node: Node) -> None:
        alarms = self.data["alarms"]
        if node.key[0] == "alarm":
            alarm = next(a for a in alarms if a["time"] == node.key[1])
            alarm["on"] = not alarm["on"]
            return
        time = self.fields.get(("new",), "").strip()
        if not TIME.match(time):
            raise ToolError(f"invalid time {time!r}; type HH:MM first")
        if any(a["time"] == time for a in alarms):
            raise ToolError(f"an alarm at {time} exists")
        alarms.append({"time": time, "on": True})
        alarms.sort(key=lambda a: a["time"])
        self.fields.pop(("new",))


class ContactsApp(App):
    title = "Contacts"

    def nodes(self, screen: str) -> list[Node]:
        if screen == "home":
            return [Node("button", c["name"], key=("open", c["name"]), item=True) for c in self.data["contacts"]]
        contact = self._contact(screen.split(":", 1)[1])
        return [
            Node("text", "Phone", contact["phone"]),
            Node("switch", "Favorite", on_off(contact["favorite"]), ("favorite", contact["name"])),
            Node("button", "Delete", key=("delete", contact["name"])),
        ]

    def _contact(self, name: str) -> dict:
        return next(c for c in self.data["contacts"] if c["name"] == name)

    def activate(self, node: Node) -> None:
        kind, name = node.key
        if kind == "open":
            self.open(f"contact:{name}")
        elif kind == "favorite":
            self._contact(name)["favorite"] = not self._contact(name)["favorite"]
        else:
            self.data["contacts"].remove(self._contact(name))
            self.close()


class ShoppingApp(App):
    title = "Shop"

    def nodes(self, screen: str) -> list[Node]:
        if screen == "home":
            return [Node("button", p, key=("open", p), item=True) for p in self.data["products"]]
        product = screen.split(":", 1)[1]
        return [
            Node("text", "In cart", str(self.data["cart"].get(product, 0))),
            Node("field", "Quantity", self.fields.get(("quantity", product), "1"), ("quantity", product)),
            Node("button", "Add to cart", key=("add", product)),
        ]

    def activate(self, node: Node) -> None:
        kind, product = node.key
        if kind == "open":
            self.open(f"product:{product}")
            return
        text = self.fields.get(("quantity", product), "1").strip()
        if not text.isdigit() or not 1 <= int(text) <= MAX_QUANTITY:
            raise ToolError(f"quantity must be 1 to {MAX_QUANTITY}")
        self.data["cart"][product] = self.data["cart"].get(product, 0) + int(text)
        self.fields.pop(("quantity", product), None)


APPS: dict[str, type[App]] = {"settings": SettingsApp, "alarms": AlarmsApp, "contacts": ContactsApp, "shopping": ShoppingApp}
