"""A seeded generator of fictional question answering over several documents (facts no model knows).

Every item is a set of short documents (a few people and companies of an invented world, each
document a paragraph of facts), one question, and its short gold answer:

- ``single``: the answer is stated in one document ("What is the name of Tavi Ornel's dog?");
- ``cross``: it takes two documents: one says that a person is known by a nickname ("Tavi
  Ornel is known in town as the Copper Heron"), another, only under the nickname, gives the
  fact asked about ("The Copper Heron keeps a goat named Lusa"), and the question names the
  person ("What is the name of Tavi Ornel's goat?"). Only attention across documents links
  them: what a document cached on its own cannot do, and what a blend must restore.

The other documents are distractors of the same shape (other people, other companies, with
different facts), and the documents come in a random order. Names are built from syllables, so
they are unknown to any model; facts are drawn independently, so nothing can be guessed.

Splits: item ``i`` is generated from seed ``SEED + i``; items ``0 .. 199`` are the **dev** split
(tune methods and defaults on them), items ``1000 ..`` the **test** split (report only). The same
index always gives the same item, on any machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEED = 20261201
DEV = range(0, 200)
TEST = range(1000, 1200)

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kr",
    "st",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "l", "r", "s", "th", "m"]
_PROFESSIONS = [
    "baker",
    "carpenter",
    "teacher",
    "nurse",
    "fisher",
    "weaver",
    "painter",
    "librarian",
    "brewer",
    "potter",
    "surveyor",
    "glassblower",
]
_ANIMALS = ["dog", "cat", "parrot", "goat", "tortoise", "rabbit", "horse", "canary"]
_COLOURS = ["green", "amber", "violet", "crimson", "teal", "silver", "ochre", "indigo"]
_INSTRUMENTS = ["cello", "flute", "accordion", "harp", "trumpet", "violin", "drum", "lute"]
_INDUSTRIES = [
    "shipbuilding",
    "textile",
    "printing",
    "clockmaking",
    "ceramics",
    "salt",
    "lantern",
    "rope",
]
_ADJECTIVES = [
    "Copper",
    "Silent",
    "Crooked",
    "Golden",
    "Patient",
    "Northern",
    "Hollow",
    "Salted",
    "Quiet",
    "Red",
]
_NOUNS = [
    "Heron",
    "Lantern",
    "Anchor",
    "Fox",
    "Bell",
    "Kettle",
    "Compass",
    "Owl",
    "Needle",
    "Harbour",
]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    ).capitalize()


@dataclass(frozen=True)
class Person:
    name: str
    town: str
    profession: str
    born: int
    animal: str
    pet: str
    colour: str
    instrument: str
    nickname: str

    @property
    def first(self) -> str:
        return self.name.split()[0]

    def facts(self, rng: random.Random, who: str) -> list[str]:
        """One sentence per fact, in words chosen at random (``who`` names the person)."""
        return [
            rng.choice(
                [
                    f"{who} keeps a {self.animal} named {self.pet}.",
                    f"{who} has a {self.animal}; its name is {self.pet}.",
                    f"The {self.animal} that lives with {who} is called {self.pet}.",
                ]
            ),
            rng.choice(
                [
                    f"{who} lives in the town of {self.town}.",
                    f"{who}'s home is in the town of {self.town}.",
                    f"For many years {who} has lived in {self.town}.",
                ]
            ),
            rng.choice(
                [
                    f"{who}'s favourite colour is {self.colour}.",
                    f"{who} likes the colour {self.colour} best.",
                ]
            ),
            rng.choice(
                [
                    f"On Sundays {who} plays the {self.instrument}.",
                    f"{who} plays the {self.instrument} in a small band.",
                ]
            ),
            rng.choice(
                [f"{who} was born in {self.born}.", f"{who} was born in the year {self.born}."]
            ),
        ]

    def document(self, rng: random.Random) -> str:
        facts = self.facts(rng, self.first)
        rng.shuffle(facts)
        return f"{self.name} works as a {self.profession}. " + " ".join(facts)

    def alias_documents(self, rng: random.Random) -> tuple[str, str]:
        """Two documents: who the nickname is, and the facts told under the nickname only."""
        intro = (
            f"{self.name} works as a {self.profession}. In town, {self.first} is known to everyone as the "
            f"{self.nickname}."
        )
        facts = self.facts(rng, f"the {self.nickname}")
        rng.shuffle(facts)
        return intro, " ".join(f[0].upper() + f[1:] for f in facts)


@dataclass(frozen=True)
class Item:
    index: int
    split: str
    kind: str  # "single" | "cross"
    documents: tuple[str, ...]
    question: str
    answer: str
    gold_documents: tuple[int, ...]  # indices into documents


def _person(rng: random.Random, used: set[str]) -> Person:
    while (name := f"{_word(rng, 2)} {_word(rng, 2)}") in used:
        pass
    used.add(name)
    while (nickname := f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}") in used:
        pass
    used.add(nickname)
    return Person(
        name,
        _word(rng, 3),
        rng.choice(_PROFESSIONS),
        rng.randint(1930, 1999),
        rng.choice(_ANIMALS),
        _word(rng, 2),
        rng.choice(_COLOURS),
        rng.choice(_INSTRUMENTS),
        nickname,
    )


def _question(rng: random.Random, p: Person) -> tuple[str, str]:
    field = rng.choice(["pet", "town", "colour", "instrument", "born"])
    return {
        "pet": (f"What is the name of {p.name}'s {p.animal}?", p.pet),
        "town": (f"In which town does {p.name} live?", p.town),
        "colour": (f"What is {p.name}'s favourite colour?", p.colour),
        "instrument": (f"Which instrument does {p.name} play?", p.instrument),
        "born": (f"In which year was {p.name} born?", str(p.born)),
    }[field]


def item(index: int, n_documents: int = 5) -> Item:
    """Item ``index`` (see the module docstring for the splits), with ``n_documents`` documents."""
    split = "dev" if index in DEV else "test" if index in TEST else "other"
    rng = random.Random(SEED + index)
    used: set[str] = set()
    kind = "cross" if rng.random() < 0.3 else "single"
    people = [_person(rng, used) for _ in range(n_documents)]
    target = people[0]
    question, answer = _question(rng, target)
    if kind == "single":
        docs = [p.document(rng) for p in people]
        gold_docs = [0]
    else:
        intro, told = target.alias_documents(rng)
        docs = [intro, told] + [p.document(rng) for p in people[1 : n_documents - 1]]
        gold_docs = [0, 1]
    order = list(range(len(docs)))
    rng.shuffle(order)
    shuffled = tuple(docs[i] for i in order)
    gold = tuple(sorted(order.index(g) for g in gold_docs))
    return Item(index, split, kind, shuffled, question, answer, gold)


def items(split: str, n: int, n_documents: int = 5) -> list[Item]:
    """The first ``n`` items of ``split`` ("dev" or "test")."""
    indices = {"dev": DEV, "test": TEST}[split]
    if n > len(indices):
        raise ValueError(f"the {split} split has {len(indices)} items")
    return [item(i, n_documents) for i in indices[:n]]


if __name__ == "__main__":
    for it in items("dev", 3):
        print(f"--- item {it.index} ({it.kind}, gold documents {it.gold_documents})")
        for d in it.documents:
            print(" *", d)
        print(" Q:", it.question, "->", it.answer)
