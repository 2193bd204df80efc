"""Tiny offline tasks for checking the lm-eval adapter end to end (``blockgen_toy_*``).

The documents are generated from a few templates with a fixed seed, so the tasks need no data files
and no hub; a test model trained for a few dozen steps on `training_text()` already does better
than chance on them. They check plumbing, not models.

- ``blockgen_toy_cloze`` (loglikelihood): the last word of a sentence after its beginning.
- ``blockgen_toy_ppl`` (loglikelihood_rolling): paragraphs of sentences, some longer than a small
  model's window.
- ``blockgen_toy_gen`` (generate_until): ``a plus b is`` -> `` c`` (stops at a newline).
- ``blockgen_toy_mc`` (multiple_choice): ``a plus b is`` with the nine possible sums as choices.
"""

from __future__ import annotations

import random

ADJECTIVES = ["red", "small", "happy", "old", "green", "quiet"]
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "mouse"]
VERBS = ["sees", "chases", "likes", "finds"]
OBJECTS = ["ball", "tree", "house", "river", "stone", "box"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def sentence(rng: random.Random) -> str:
    return f"the {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} the {rng.choice(OBJECTS)} ."


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(5), rng.randrange(5)
    return f"{NUMBERS[a]} plus {NUMBERS[b]} is", f" {NUMBERS[a + b]}"


def training_text(n: int, seed: int = 0) -> list[str]:
    """Documents to train a test model on: one addition, or one to three sentences."""
    rng = random.Random(seed)
    return ["".join(addition(rng)) if rng.random() < 0.4 else " ".join(sentence(rng) for _ in range(rng.randint(1, 3)))
            for _ in range(n)]


def _dataset(rows: list[dict]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(rows)})


def load_cloze(**_metadata):
    rng = random.Random(1)
    rows = []
    for _ in range(32):
        words = sentence(rng).split(" ")
        rows.append({"context": " ".join(words[:-2]), "target": " " + words[-2]})
    return _dataset(rows)


def load_ppl(**_metadata):
    rng = random.Random(2)
    return _dataset([{"text": " ".join(sentence(rng) for _ in range(rng.randrange(2, 12)))} for _ in range(16)])


def load_gen(**_metadata):
    rng = random.Random(3)
    rows = []
    for _ in range(16):
        question, answer = addition(rng)
        rows.append({"question": question, "answer": answer.strip()})
    return _dataset(rows)


def load_mc(**_metadata):
    rng = random.Random(4)
    rows = []
    for _ in range(25):
        question, answer = addition(rng)
        rows.append({"question": question, "choices": [f" {n}" for n in NUMBERS[:9]], "label": NUMBERS.index(answer.strip())})
    return _dataset(rows)
