"""A deterministic two-hop question collection (2WikiMultihopQA-style), generated from a fixed seed.

Every task has a work W (a film or a book), its maker P (director / author) and P's spouse S. Documents:

    "Kalomi: film directed by Ravute."
    "Ravute: born in Belo, lives in Sika, married to Dupami."
    "Dupami: born in Tuka, lives in Belo, married to Ravute."

A question about W needs two lookups: W's document names P (the bridge), P's document holds the answer:
"Where was the director of Kalomi born?" -> search("Kalomi") -> search("Ravute") -> "Belo".
Names are built from a small syllable set so a byte-level tokenizer sees a small vocabulary; every task
has its own W, P and S, so test tasks ask about entities no train task mentions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

SEED = 1234
N_TASKS = 500
TEST_EVERY = 5  # task i is in the test split when i % TEST_EVERY == TEST_EVERY - 1 (100 test, 400 train)
SYLLABLES = ("ka", "lo", "mi", "ra", "ve", "tu", "so", "ne", "pi", "da", "ru", "be", "go", "fe")
N_CITIES = 24

# relation -> (question template with {role} and {work}, answer field of the maker's record)
RELATIONS = {
    "born": "Where was the {role} of {work} born?",
    "lives": "Where does the {role} of {work} live?",
    "spouse": "Who is the spouse of the {role} of {work}?",
}
KINDS = {"film": ("director", "directed by"), "book": ("author", "written by")}


@dataclass(frozen=True)
class Person:
    name: str
    born: str
    lives: str
    spouse: str

    def passage(self) -> str:
        return f"{self.name}: born in {self.born}, lives in {self.lives}, married to {self.spouse}."


@dataclass(frozen=True)
class Task:
    id: str
    split: str  # "train" | "test"
    kind: str  # "film" | "book"
    relation: str  # a key of RELATIONS
    work: str
    maker: Person
    spouse: Person

    @property
    def question(self) -> str:
        return RELATIONS[self.relation].format(role=KINDS[self.kind][0], work=self.work)

    @property
    def answer(self) -> str:
        return {"born": self.maker.born, "lives": self.maker.lives, "spouse": self.maker.spouse}[self.relation]

    def work_passage(self) -> str:
        return f"{self.work}: {self.kind} {KINDS[self.kind][1]} {self.maker.name}."


def _namer(rng: random.Random, syllables: int):
    used: set[str] = set()

    def fresh() -> str:
        while True:
            name = "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()
            if name not in used:
                used.add(name)
                return name

    return fresh


@cache
def tasks() -> tuple[Task, ...]:
    """All tasks, in id order (generated once per process)."""
    rng = random.Random(SEED)
    city = _namer(rng, 2)
    cities = [city() for _ in range(N_CITIES)]
    name = _namer(rng, 3)  # 3 syllables: never equal to a 2-syllable city
    out = []
    for i in range(N_TASKS):
        work, maker_name, spouse_name = name(), name(), name()
        maker = Person(maker_name, rng.choice(cities), rng.choice(cities), spouse_name)
        spouse = Person(spouse_name, rng.choice(cities), rng.choice(cities), maker_name)
        split = "test" if i % TEST_EVERY == TEST_EVERY - 1 else "train"
        kind, relation = rng.choice(sorted(KINDS)), rng.choice(sorted(RELATIONS))
        out.append(Task(f"search-{i:04d}", split, kind, relation, work, maker, spouse))
    return tuple(out)


@cache
def task_by_id() -> dict[str, Task]:
    return {task.id: task for task in tasks()}


def passages() -> list[str]:
    """The document collection: three passages per task."""
    return [p for t in tasks() for p in (t.work_passage(), t.maker.passage(), t.spouse.passage())]
