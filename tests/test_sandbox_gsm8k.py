"""gsm8k_code's code extraction on real GSM8K test records: completions of every shape a model gives
(trailing prose, fences, an appended call) extracted, run in the sandbox and scored by the task's
is_correct; and extract_code on each shape alone."""

from __future__ import annotations

import json

import pytest

from blockgen.tasks.sandbox import Outcome, run_many, run_program
from blockgen.tasks.gsm8k_code import extract_code, is_correct  # the task's, on the sandbox's results
from sandbox_helpers import FAST, GSM8K

# Sandbox runs with wall clocks of a second or two, or processes that take both cores: alone under xdist.
pytestmark = [pytest.mark.whole_machine, pytest.mark.runs_programs]


# --- code extraction on real GSM8K records (scored by the task's is_correct) ---------------------


@pytest.fixture(scope="module")
def gsm8k() -> list[dict[str, str]]:
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} not found")
    return json.loads(GSM8K.read_text())


SOLUTIONS = {  # TinyGSM-style programs for the first GSM8K test records
    0: """def simple_math_problem() -> int:
    eggs_per_day = 16
    eaten = 3
    baked = 4
    price = 2
    result = (eggs_per_day - eaten - baked) * price
    return result""",
    1: """def simple_math_problem() -> float:
    blue = 2
    white = blue / 2
    result = blue + white
    return result""",
    2: """def simple_math_problem() -> int:
    cost = 80000 + 50000
    value = 80000 * (1 + 150 / 100)
    result = value - cost
    return result""",
    3: """import math

def simple_math_problem() -> int:
    sprints, times, meters = 3, 3, 60
    result = math.prod([sprints, times, meters])
    return result""",
}


def completions(code: str, question: str) -> list[str]:
    """Shapes a model completion takes: bare, with trailing prose, fenced, a call appended."""
    return [
        code,
        code + "\n\nThe answer is the value returned by the function.\n\nQuestion: next one?",
        f"Let's solve: {question}\n```python\n{code}\n```\nSo the answer follows.",
        code + "\n\nprint(simple_math_problem())\nAnswer: 42\n",
    ]


def test_extract_run_and_score_real_records(gsm8k) -> None:
    jobs = [
        (i, text)
        for i, code in SOLUTIONS.items()
        for text in completions(code, gsm8k[i]["prompt"])
    ]
    codes = [extract_code(text) for _, text in jobs]
    for code in codes:
        assert "def simple_math_problem" in code
        assert not any(prose in code for prose in ("```", "answer", "Answer", "Question"))
    results = run_many(codes, FAST)
    for (i, text), r in zip(jobs, results):
        assert r.outcome is Outcome.OK, (text, r)
        assert is_correct(r, gsm8k[i]["response_ground_truth"]), (text, r.value)
    wrong = run_program(SOLUTIONS[0].replace("* price", "* price + 1"), FAST)
    assert wrong.ok and not is_correct(wrong, gsm8k[0]["response_ground_truth"])


def test_extract_code_shapes() -> None:
    body = "def simple_math_problem():\n    return 1\n"
    assert extract_code(body) == body
    assert extract_code("Here you go:\n" + body + "\nHope this helps!") == body
    assert extract_code("```py\n" + body + "```\ntext") == body
    assert extract_code("```\nnot it\n```\n```python\n" + body + "```") == body
    two = "import math\n\ndef helper(x):\n    return x\n\n" + body
    two += "\nresult = simple_math_problem()\n"
    assert extract_code(two + "Result = 18 dollars.\n") == two
    assert extract_code(body + "Answer: 1\n") == body
    assert extract_code(body + "\n\n" + body.replace("1", "2")) == body  # the next problem
    assert extract_code("no code at all") == "no code at all\n"
    # an unterminated fence, as when generation stops at the token limit
    assert extract_code("```python\n" + body) == body
