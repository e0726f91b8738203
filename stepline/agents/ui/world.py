"""Deterministic UI tasks: 100 per app, generated from a fixed seed, with a fixed train/test split.

A task is an instruction, the app's initial data, the data the app must end with (`target`), the
simulated user's answer to any question (`user_reply`: set when the instruction withholds a detail
the agent must ask for) and the expert's plan: goals such as ("tap", label) or ("type", label, text),
where "{reply}" stands for the user's answer. Every task takes at most 3 actions.
Contact and product names are fresh per task (built from a small syllable set), so test tasks name
entities no train task mentions.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from functools import cache
from typing import Any

from stepline.agents.ui.apps import SECTIONS, on_off

SEED = 4321
N_TASKS = 400
TEST_EVERY = 5  # task i is a test task when i % 5 == 4 (80 test tasks, 20 per app)
APP_ORDER = ("settings", "alarms", "contacts", "shopping")
SYLLABLES = ("ka", "lo", "mi", "ra", "ve", "tu", "so", "ne", "pi", "da", "ru", "be", "go", "fe")
PRODUCT_KINDS = ("tea", "rice", "soap", "milk")
RELATIONS = ("dentist", "boss", "cousin", "coach")
DEFAULT_REPLY = "Just do what I asked."

Goal = tuple[str, ...]


@dataclass(frozen=True)
class Task:
    id: str
    split: str
    app: str
    kind: str
    instruction: str
    data: dict[str, Any]
    target: dict[str, Any]
    plan: tuple[Goal, ...]
    user_reply: str | None = None  # the withheld detail, given only when the agent asks


# The instructions of the kinds a done state describes (the generators' and hindsight relabelling's; see hindsight.py)
def toggle_text(toggle: str, on: bool) -> str:
    return f"Turn {on_off(on)} {toggle}."


def alarm_text(time: str, on: bool) -> str:
    return f"Turn {on_off(on)} the {time} alarm."


def add_alarm_text(time: str) -> str:
    return f"Add an alarm at {time}."


def favorite_text(name: str) -> str:
    return f"Add {name} to favorites."


def delete_text(name: str) -> str:
    return f"Delete the contact {name}."


def buy_text(product: str, quantity: int = 1) -> str:
    return f"Add {product} to the cart." if quantity == 1 else f"Add {quantity} {product} to the cart."


def _word(rng: random.Random, used: set[str], syllables: int) -> str:
    while (word := "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()) in used:
        pass
    used.add(word)
    return word


def _settings(rng: random.Random, used: set[str]) -> tuple:
    sections = rng.sample(sorted(SECTIONS), len(SECTIONS))
    toggles = {t: rng.random() < 0.5 for ts in SECTIONS.values() for t in ts}
    section = rng.choice(sections)
    toggle = rng.choice(SECTIONS[section])
    data: dict[str, Any] = {"sections": sections, "toggles": toggles}
    target = copy.deepcopy(data)
    target["toggles"][toggle] = not toggles[toggle]
    return "toggle", toggle_text(toggle, not toggles[toggle]), data, target, (("tap", section), ("tap", toggle)), None


def _alarms(rng: random.Random, used: set[str]) -> tuple:
    times = rng.sample([f"{h:02d}:{m:02d}" for h in range(5, 12) for m in range(0, 60, 15)], rng.randint(3, 6))
    alarms = [{"time": t, "on": rng.random() < 0.5} for t in sorted(times[1:])]
    data = {"alarms": alarms}
    kind = rng.choice(("add", "ask", "switch"))
    if kind == "switch":
        alarm = rng.choice(alarms)
        target = copy.deepcopy(data)
        next(a for a in target["alarms"] if a["time"] == alarm["time"])["on"] = not alarm["on"]
        return kind, alarm_text(str(alarm["time"]), not alarm["on"]), data, target, (("tap", alarm["time"]),), None
    new = times[0]
    target = {"alarms": sorted([*alarms, {"time": new, "on": True}], key=lambda a: str(a["time"]))}
    if kind == "add":
        return kind, add_alarm_text(new), data, target, (("type", "New alarm", new), ("tap", "Add")), None
    plan = (("ask", "What time?"), ("type", "New alarm", "{reply}"), ("tap", "Add"))
    return kind, "Add an alarm.", data, target, plan, new


def _contacts(rng: random.Random, used: set[str]) -> tuple:
    kind = rng.choice(("favorite", "delete", "ask"))
    n = rng.randint(3, 4) if kind == "ask" else rng.randint(3, 6)  # ask: no scrolling (3 actions at most)
    names = sorted(_word(rng, used, 3) for _ in range(n))
    contacts = [{"name": m, "phone": f"555-01{rng.randint(10, 99)}", "favorite": rng.random() < 0.3} for m in names]
    name = rng.choice(names)
    data = {"contacts": contacts}
    target = copy.deepcopy(data)
    contact = next(c for c in target["contacts"] if c["name"] == name)
    if kind == "delete":
        target["contacts"].remove(contact)
        return kind, delete_text(name), data, target, (("tap", name), ("tap", "Delete")), None
    next(c for c in data["contacts"] if c["name"] == name)["favorite"] = False
    contact["favorite"] = True
    if kind == "favorite":
        return kind, favorite_text(name), data, target, (("tap", name), ("tap", "Favorite")), None
    relation = rng.choice(RELATIONS)
    plan = (("ask", f"Who is your {relation}?"), ("tap", "{reply}"), ("tap", "Favorite"))
    return kind, f"Add my {relation} to favorites.", data, target, plan, name


def _shopping(rng: random.Random, used: set[str]) -> tuple:
    kind = rng.choice(("buy", "quantity", "ask"))
    n = rng.randint(3, 6) if kind == "buy" else rng.randint(3, 4)  # no scrolling when 3 actions are needed
    products = [f"{_word(rng, used, 3)} {rng.choice(PRODUCT_KINDS)}" for _ in range(n)]
    cart = {rng.choice(products): 1} if rng.random() < 0.3 else {}
    product = rng.choice(products)
    data = {"products": products, "cart": cart}
    quantity = rng.randint(2, 5) if kind == "quantity" else 1
    target = {"products": products, "cart": {**cart, product: cart.get(product, 0) + quantity}}
    if kind == "buy":
        return kind, buy_text(product), data, target, (("tap", product), ("tap", "Add to cart")), None
    if kind == "quantity":
        plan: tuple[tuple[str, ...], ...] = (("tap", product), ("type", "Quantity", str(quantity)), ("tap", "Add to cart"))
        return kind, buy_text(product, quantity), data, target, plan, None
    product_kind = product.split()[1]
    plan = (("ask", f"Which {product_kind}?"), ("tap", "{reply}"), ("tap", "Add to cart"))
    return kind, f"Add my usual {product_kind} to the cart.", data, target, plan, product


GENERATORS = {"settings": _settings, "alarms": _alarms, "contacts": _contacts, "shopping": _shopping}


@cache
def tasks() -> tuple[Task, ...]:
    rng = random.Random(SEED)
    used: set[str] = set()
    out = []
    for i in range(N_TASKS):
        app = APP_ORDER[i % len(APP_ORDER)]
        kind, text, data, target, plan, reply = GENERATORS[app](rng, used)
        split = "test" if i % TEST_EVERY == TEST_EVERY - 1 else "train"
        out.append(Task(f"ui-{i:04d}", split, app, kind, text, data, target, plan, reply))
    return tuple(out)


@cache
def task_by_id() -> dict[str, Task]:
    return {task.id: task for task in tasks()}
