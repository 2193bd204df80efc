"""Tests for the procedural TinyGSM-style word problems (blockgen.harness.data.wordproblems)."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import keyword
import re
from collections import Counter

import pytest

from blockgen.harness.data import wordproblems as wp

NUMBER = re.compile(r"\d+")
ASSIGN = re.compile(r"    (\w+) = (\d+)")


@pytest.fixture(scope="module")
def train() -> list[wp.WordProblem]:
    return wp.generate("train", 20_000, seed=0, level="hard")


@pytest.fixture(scope="module")
def test_split() -> list[wp.WordProblem]:
    return wp.generate("test", 2_000, seed=0, level="hard")


@pytest.fixture(scope="module")
def validation() -> list[wp.WordProblem]:
    return wp.generate("validation", 1_000, seed=0, level="hard")


def run(code: str) -> object:
    ns: dict[str, object] = {}
    exec(code, ns)  # noqa: S102 - the code is ours
    return ns["simple_math_problem"]()  # type: ignore[operator]


def test_deterministic_and_prefix_stable() -> None:
    for split in wp.SPLITS:
        a = wp.generate(split, 300, seed=7)
        assert a == wp.generate(split, 300, seed=7)
        assert wp.generate(split, 100, seed=7) == a[:100]


def test_seed_changes_problems() -> None:
    a = [p.question for p in wp.generate("train", 200, seed=0)]
    b = [p.question for p in wp.generate("train", 200, seed=1)]
    assert sum(x != y for x, y in zip(a, b)) > 190


def test_bad_split_and_n() -> None:
    with pytest.raises(ValueError, match="train, validation, test"):
        wp.generate("dev", 3)
    with pytest.raises(ValueError):
        wp.generate("train", -1)
    assert wp.generate("test", 0) == []


@pytest.mark.parametrize("split,n", [("train", 3000), ("validation", 1000), ("test", 2000)])
def test_code_returns_answer(split: str, n: int) -> None:
    problems = wp.generate(split, n, seed=3)
    for p in problems:
        got = run(p.code)
        assert type(got) is int and got == p.answer, (p.question, p.code, got)
        assert type(p.answer) is int and 0 <= p.answer < 10_000


def test_code_format(train: list[wp.WordProblem]) -> None:
    names_bad = set(keyword.kwlist) | set(dir(builtins)) | {"result"}
    for p in train[:3000]:
        lines = p.code.split("\n")
        assert lines[0] == "def simple_math_problem() -> int:"
        assert lines[-2] == f"    result = {lines[-3].split(' = ')[0].strip()}"
        assert lines[-1] == "    return result"
        assert all(line.startswith("    ") and not line.startswith("     ") for line in lines[1:])
        # Assignments of question numbers come first, then computations.
        body = lines[1:-2]
        n_assign = sum(1 for line in body if ASSIGN.fullmatch(line))
        assert all(ASSIGN.fullmatch(line) for line in body[:n_assign])
        assert not any(ASSIGN.fullmatch(line) for line in body[n_assign:])
        assert n_assign >= 2 and len(body) - n_assign >= 2  # several reasoning steps
        targets = [node.id for node in ast.walk(ast.parse(p.code)) if isinstance(node, ast.Name)
                   and isinstance(node.ctx, ast.Store)]
        assert len(targets) == len(set(targets)), p.code  # no variable reassigned
        assert not (set(targets) - {"result"}) & names_bad, p.code


def test_numbers_come_from_question(train: list[wp.WordProblem]) -> None:
    for p in train[:5000]:
        in_question = set(NUMBER.findall(p.question))
        assigned = {m.group(2) for m in map(ASSIGN.fullmatch, p.code.split("\n")) if m}
        assert assigned <= in_question, (p.question, p.code)
        if p.distractors == 0:  # every number in the question is needed
            assert in_question <= assigned, (p.question, p.code)
    # A distractor number is really unused: some distractor questions hold an unassigned number.
    with_distractor = [p for p in train[:2000] if p.distractors]
    assert with_distractor
    unused = sum(
        bool(set(NUMBER.findall(p.question)) - {m.group(2) for m in map(ASSIGN.fullmatch, p.code.split("\n")) if m})
        for p in with_distractor
    )
    assert unused > 0.8 * len(with_distractor)


def test_splits_are_disjoint(
    train: list[wp.WordProblem], test_split: list[wp.WordProblem], validation: list[wp.WordProblem]
) -> None:
    train_q = {p.question for p in train}
    test_q = {p.question for p in test_split}
    val_q = {p.question for p in validation}
    assert not train_q & test_q
    assert not train_q & val_q
    assert not test_q & val_q
    for split, problems in (("train", train), ("test", test_split), ("validation", validation)):
        assert all(wp.question_split(p.question) == split for p in problems)


def test_heldout_structures(train: list[wp.WordProblem], test_split: list[wp.WordProblem]) -> None:
    assert not any(wp.is_heldout(p) for p in train)
    assert not any(wp.is_heldout(p) for p in wp.generate("validation", 500, seed=1))
    frac = sum(wp.is_heldout(p) for p in test_split) / len(test_split)
    assert 0.2 < frac < 0.4  # the rest is in distribution, with unseen numbers
    train_structs = {p.structure for p in train}
    unseen = [p for p in test_split if p.structure not in train_structs]
    assert len(unseen) > 0.15 * len(test_split)
    # Both kinds of hold-out occur: unseen phrasings and unseen chainings.
    assert any(wp.is_heldout(p) and not p.followups for p in test_split)
    # phrasing=-1 switches off the phrasing hold-out, leaving only the chaining one.
    assert any(wp.is_heldout(p) and p.followups and wp.is_heldout(dataclasses.replace(p, phrasing=-1))
               for p in test_split)


def test_variety(train: list[wp.WordProblem]) -> None:
    assert len(wp.TEMPLATES) >= 25
    assert {p.template for p in train} == set(wp.TEMPLATES)
    assert len({(p.template, p.phrasing) for p in train}) >= 60
    depth = Counter(len(p.followups) for p in train)
    assert depth[1] > 0.15 * len(train) and depth[2] > 0.03 * len(train)
    assert len({f for p in train for f in p.followups}) == len(wp.FOLLOWUPS)
    assert 0.2 < sum(p.distractors > 0 for p in train) / len(train) < 0.4
    assert len({p.question for p in train}) > 0.95 * len(train)
    names = {m for p in train[:2000] for m in re.findall(r"\b[A-Z][a-z]+\b", p.question)}
    assert len(names) > 40  # people and capitalised words vary


def test_lengths_fit_small_context(train: list[wp.WordProblem]) -> None:
    q = sorted(len(p.question) for p in train)
    c = sorted(len(p.code) for p in train)
    assert sum(q) / len(q) < 160 and q[int(0.95 * len(q))] < 240
    assert sum(c) / len(c) < 260 and c[int(0.95 * len(c))] < 360


def test_records_and_frozen() -> None:
    problems = wp.generate("validation", 5, seed=2)
    records = wp.to_records(problems)
    assert [set(r) for r in records] == [{"question", "code", "answer"}] * 5
    assert [r["answer"] for r in records] == [p.answer for p in problems]
    assert records[0]["question"] == problems[0].question and records[0]["code"] == problems[0].code
    with pytest.raises(dataclasses.FrozenInstanceError):
        problems[0].answer = 1  # type: ignore[misc]


@pytest.mark.parametrize("level", sorted(wp.DIFFICULTIES))
def test_difficulty_levels_keep_the_split_rule(level: str) -> None:
    knobs = wp.DIFFICULTIES[level]
    train = wp.generate("train", 3000, seed=0, level=level)
    test = wp.generate("test", 1000, seed=0, level=level)
    allowed = set(wp.TEMPLATES[: knobs.templates])
    assert {p.template for p in train} == allowed  # every allowed template, nothing else
    assert {p.template for p in test} <= allowed
    depth = Counter(len(p.followups) for p in train)
    assert max(depth) <= max(i for i, w in enumerate(knobs.depth_weights) if w > 0)
    assert abs(sum(p.distractors > 0 for p in train) / len(train) - knobs.distractor_prob) < 0.04
    assert not any(wp.is_heldout(p) for p in train)
    assert 0.2 < sum(wp.is_heldout(p) for p in test) / len(test) < 0.4
    assert all(wp.question_split(p.question) == "test" for p in test)
    for p in train[:300] + test[:300]:
        assert run(p.code) == p.answer


def test_easier_levels_have_fewer_structures() -> None:
    structures = {level: len({p.structure for p in wp.generate("train", 3000, seed=0, level=level)})
                  for level in ("easy", "medium", "hard")}
    assert structures["easy"] < structures["medium"] < structures["hard"]


def test_difficulty_errors_name_the_choices() -> None:
    with pytest.raises(ValueError, match="easy.*hard.*medium"):
        wp.generate("train", 3, level="trivial")
    single_step = wp.Difficulty(templates=1, depth_weights=(1.0, 0.0, 0.0))  # its template has no held-out phrasing
    assert len(wp.generate("train", 5, level=single_step)) == 5
    with pytest.raises(ValueError, match="no structure to hold out"):
        wp.generate("test", 5, level=single_step)
    one_template = wp.Difficulty(templates=1, depth_weights=(0.5, 0.5, 0.0))
    assert {p.template for p in wp.generate("test", 50, seed=0, level=one_template)} == {wp.TEMPLATES[0]}
