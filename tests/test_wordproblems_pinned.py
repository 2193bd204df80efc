"""The word-problem generator's output, pinned by SHA-256: a refactoring of the catalogue
(blockgen.harness.data.wordproblems) must not change a single problem.

What is pinned (`generator_digest`, `prepare_data_digest`): every field of every problem (question,
code, answer, template, phrasing, follow-ups, distractors) plus `is_heldout` and `question_split` of
it, and the catalogue's template and follow-up names in order. Rows hold only strings and ints, so the
JSON is the same on every platform (no float repr). Problems are cheap (about 2 s for all of it).

To change the generator on purpose (new template, new phrasing, a fixed draw): run this file, check
that the new output is what you meant (e.g. diff `generate(...)` before and after), then paste the
digests the failures print here, and say in the commit why the data changed. Prepared caches and local
tokenizers hash their inputs, so they are rebuilt on their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from blockgen.harness.data.wordproblems import FOLLOWUPS, SPLITS, TEMPLATES, generate, is_heldout, question_split

# Every level x every split x seeds 0 and 1, the first 300 problems of each.
GENERATOR_SHA256 = "704175cad3f3c891d6f125605ccdb83650405a2a93506cadecdf9f9e9d46e975"
# What `blockgen prepare-data` writes for the default DataConfig (wordproblems, seed 0, level "easy",
# n_train 50_000, n_val 256): the train and validation problems it tokenizes.
PREPARE_DATA_SHA256 = "0ed31351f9a3f9bc5711a71d6bc1077b9fbedeba86639b71beb736438d0b5fe1"


def _digest(rows) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode() + b"\n")
    return h.hexdigest()


def _rows(split: str, n: int, seed: int, level: str):
    for p in generate(split, n, seed=seed, level=level):
        row = dataclasses.asdict(p)
        row["followups"] = list(p.followups)
        row.update(heldout=is_heldout(p), bucket=question_split(p.question))
        yield {"split": split, "seed": seed, "level": level, **row}


def generator_digest() -> str:
    def rows():
        yield {"templates": list(TEMPLATES), "followups": list(FOLLOWUPS)}
        for level in ("easy", "medium", "hard"):
            for split in SPLITS:
                for seed in (0, 1):
                    yield from _rows(split, 300, seed, level)

    return _digest(rows())


def prepare_data_digest() -> str:
    return _digest([*_rows("train", 50_000, 0, "easy"), *_rows("validation", 256, 0, "easy")])


def test_generator_output_is_pinned():
    assert generator_digest() == GENERATOR_SHA256


def test_default_prepare_data_output_is_pinned():
    assert prepare_data_digest() == PREPARE_DATA_SHA256
