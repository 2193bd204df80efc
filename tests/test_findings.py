"""Findings across training runs (`harness/reports/findings.py`): the pooled interval against a hand
computation, the rule (same sign in every run and the interval excludes 0), the floor that keeps
runs agreeing by chance from making a tiny interval, the paper's claims mapped onto the demo's grid,
and the table, JSON and plot `write_findings` leaves. `blockgen demo --seeds` end to end is in
tests/test_train.py (test_demo_command_end_to_end)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import t as student_t

from blockgen.harness.reports.compare import mean_stderr
from blockgen.harness.reports.findings import (
    Finding, demo_findings, format_spread, format_table, language_findings, plot, pool, roles, training_spread, write_findings,
    write_training_spread,
)
from blockgen.harness.evaluation.grids import demo_samplers, language_samplers, sampler_label
from blockgen.harness.training.presets import DEMO_PRESETS, LANGUAGE_PRESETS, preset

TASK = "gsm8k_code_embedded"
FINDING = Finding("claim", "A - B", ("model-a", "setting-a"), ("model-b", "setting-b"), +1)


def write_setting(run: Path, model: str, label: str, outcomes: list[int]) -> None:
    """A demo results file and its per-problem samples (the layout `make demo` writes)."""
    folder = run / "results" / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{label}.json").write_text(json.dumps({"results": {TASK: {"exact_match,none": float(np.mean(outcomes))}}}))
    rows = [{"doc_id": i, "doc_hash": f"h{i}", "exact_match": float(x)} for i, x in enumerate(outcomes)]
    (folder / f"{label}.samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_runs(tmp_path: Path, pairs: list[tuple[list[int], list[int]]]) -> list[Path]:
    runs = []
    for i, (a, b) in enumerate(pairs):
        run = tmp_path / f"seed-{i}"
        write_setting(run, *FINDING.a, a)
        write_setting(run, *FINDING.b, b)
        runs.append(run)
    return runs


def outcomes(a_only: int, b_only: int, both: int = 60, neither: int = 30, seed: int = 0) -> tuple[list[int], list[int]]:
    pairs = [(1, 1)] * both + [(1, 0)] * a_only + [(0, 1)] * b_only + [(0, 0)] * neither
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[i][0] for i in order], [pairs[i][1] for i in order]


def test_pooled_interval_against_a_hand_computation(tmp_path):
    pairs = [outcomes(12, 2, seed=0), outcomes(9, 3, seed=1), outcomes(15, 1, seed=2)]
    p = pool(FINDING, make_runs(tmp_path, pairs))
    diffs = [(sum(a) - sum(b)) / len(a) for a, b in pairs]
    assert [r["difference"] for r in p.runs] == pytest.approx(diffs)
    mean = float(np.mean(diffs))
    between = float(np.var(diffs, ddof=1))
    within = float(np.mean([mean_stderr([x - y for x, y in zip(a, b)]) ** 2 for a, b in pairs]))
    half = student_t.ppf(0.975, 2) * math.sqrt(max(between, within) / 3)
    assert (p.mean, p.low, p.high) == pytest.approx((mean, mean - half, mean + half))
    assert p.same_sign and p.resolved and p.verdict == "reproduced"
    assert [(r["a_only"], r["b_only"]) for r in p.runs] == [(12, 2), (9, 3), (15, 1)]


def test_runs_that_agree_by_chance_keep_the_within_run_noise(tmp_path):
    """Three identical small differences: no spread between runs, but each run's own sampling noise
    still sets the interval, so +1 problem of 100 is not 'resolved'."""
    pair = outcomes(3, 2)
    p = pool(FINDING, make_runs(tmp_path, [pair] * 3))
    within = mean_stderr([x - y for x, y in zip(*pair)])
    assert p.high - p.mean == pytest.approx(student_t.ppf(0.975, 2) * within / math.sqrt(3))
    assert p.same_sign and not p.resolved and p.verdict == "unresolved"


def test_a_sign_change_between_runs_is_unresolved(tmp_path):
    """Two runs far apart in one direction, one run the other way: the mean interval may exclude 0
    with a wide spread only by luck; the rule asks for the sign of every run as well."""
    pairs = [outcomes(30, 0, seed=0), outcomes(30, 0, seed=1), outcomes(0, 1, seed=2)]
    p = pool(FINDING, make_runs(tmp_path, pairs))
    assert not p.same_sign and not p.resolved


def test_opposite_of_the_paper_is_reported_as_such(tmp_path):
    pairs = [outcomes(1, 14, seed=s) for s in range(3)]
    p = pool(FINDING, make_runs(tmp_path, pairs))
    assert p.resolved and p.mean < 0 and p.verdict == "opposite resolved"
    no_claim = pool(Finding("c", "n", FINDING.a, FINDING.b, 0), make_runs(tmp_path / "x", pairs))
    assert no_claim.verdict == "resolved"


def by_name_sign(findings, name: str) -> int:
    return {f.name: f.paper_sign for f in findings}[name]


def test_the_papers_claims_map_onto_the_demo_grid():
    assert roles(DEMO_PRESETS) == {"ar": "gsm-ar", "masked": "gsm-masked-mix", "uniform": "gsm-uniform-mix"}
    findings = demo_findings(DEMO_PRESETS, (0.1,), (4, 8, 16))
    labels = set()
    for model in DEMO_PRESETS:
        labels |= {(model, sampler_label(s)) for s in demo_samplers(preset(model).block_sizes, (0.1,), (4, 8, 16))}
    assert all(f.a in labels and f.b in labels for f in findings)  # every finding compares settings the demo runs
    names = [f.name for f in findings]
    # the paper's claims, then the field's samplers beside them (no claim), per model: low-confidence against
    # ancestral at NFE 4 (its demo setting, grids.DEMO_FIELD), the two adaptive ones against ARPC and ancestral at NFE 4
    assert len(names) == len(set(names)) == 3 + 2 * 3 * 3 + 3 + 2 + 2 * (1 + 2 * 2)
    assert by_name_sign(findings, "masked: confidence_threshold (threshold 0.9) - arpc NFE 4, T 0.1") == 0
    by_name = {f.name: f for f in findings}
    assert by_name["uniform - masked, ancestral NFE 4, T 0.1"].paper_sign == +1
    assert by_name["masked: ARPC - EIPC, NFE 16, T 0.1"].paper_sign == +1
    assert by_name["uniform: ARPC NFE 4 - AR greedy, T 0.1"].b == ("gsm-uniform-mix", "ar_greedy")
    # Without a uniform mixture there is no masked-vs-uniform finding, only the masked model's own.
    assert all("uniform" not in f.name for f in demo_findings(("ci-ar", "ci"), (0.1,), (4,)))


def test_the_language_findings_map_onto_its_grid_positive_control_first():
    assert roles(LANGUAGE_PRESETS, "language") == {"ar": "lang-ar", "masked": "lang-masked-mix", "uniform": "lang-uniform-mix",
                                                   "single": "lang-masked"}
    findings = language_findings(LANGUAGE_PRESETS)
    labels = {(m, sampler_label(s)) for m in LANGUAGE_PRESETS for s in language_samplers(preset(m).block_sizes)}
    assert all(f.a in labels and f.b in labels and f.metric == "invalid_pairs" for f in findings)
    first = findings[0]
    assert (first.name, first.a, first.b, first.paper_sign) == (
        "masked: ancestral NFE 1 - NFE 16", ("lang-masked-mix", "ancestral(N1,T1)"), ("lang-masked-mix", "ancestral(N16,T1)"), +1)
    by_name = {f.name: f for f in findings}
    assert len(by_name) == len(findings) == 27  # the control, then 2 at NFE 1 (no ARPC there) and 6 at each of NFE 2-16
    assert by_name["masked: ARPC - ancestral (same network), NFE 2"].a == ("lang-masked-mix", "arpc(N1,GE1,T1)")
    assert by_name["uniform - masked mix, ancestral NFE 4"].paper_sign == -1  # fewer broken pairs: A ahead
    assert by_name["uniform - masked mix, ancestral NFE 8"].paper_sign == 0


@dataclass(frozen=True)
class _Config:
    out_dir: str
    seeds: tuple[int, ...] = (0, 1)
    presets: tuple[str, ...] = ("gsm-ar", "gsm-masked-mix")
    temperatures: tuple[float, ...] = (0.1,)
    nfes: tuple[int, ...] = (4,)


def test_write_findings_leaves_table_json_and_plot(tmp_path, capsys):
    from PIL import Image

    config = _Config(str(tmp_path))
    runs = [tmp_path, tmp_path / "seed-1"]
    findings = demo_findings(config.presets, config.temperatures, config.nfes)
    for k, run in enumerate(runs):
        for f in findings:
            for side, (model, label) in enumerate((f.a, f.b)):
                write_setting(run, model, label, outcomes(8, 1, seed=10 * k + side)[side])
        likelihood = {"nll_block_1": 0.20, "nll_block_16": 0.50, "nll_lse": 0.25 + 0.01 * k, "nll_jensen": 0.48}
        (run / "summary.json").write_text(json.dumps({"models": {"gsm-masked-mix": {"likelihood": likelihood},
                                                                 "gsm-ar": {"likelihood": {"nll_block_1": 0.2}}}}))
    doc = write_findings(config, runs)
    printed = capsys.readouterr().out
    assert [f["finding"]["name"] for f in doc["findings"]] == [f.name for f in findings]
    assert json.loads((tmp_path / "findings.json").read_text()) == json.loads(json.dumps(doc))
    assert format_table([pool(f, runs) for f in findings]) in printed
    assert [(b["model"], b["between"], b["below_jensen"]) for b in doc["mixture_bound"]] == [("gsm-masked-mix", True, True)] * 2
    with Image.open(tmp_path / "findings.png") as image:
        width, height = image.size
        pixels = np.asarray(image.convert("L"))
    assert width > 500 and height > 100 and pixels.min() < 100  # something drawn, not a blank canvas


def test_plot_colours_findings_by_verdict(tmp_path):
    from PIL import Image

    reproduced = pool(FINDING, make_runs(tmp_path / "r", [outcomes(14, 1, seed=s) for s in range(3)]))
    path = tmp_path / "one.png"
    plot([reproduced], path)
    with Image.open(path) as image:
        rgb = np.asarray(image.convert("RGB")).astype(int)
    green = (rgb[..., 1] > rgb[..., 0] + 40) & (rgb[..., 1] > rgb[..., 2] + 40)
    assert green.sum() > 20  # the reproduced finding's bar is drawn in green


def test_training_spread_judges_each_model_against_its_median_over_seeds(tmp_path, capsys):
    """Five seeds by hand: the word-problem model with one seed 4x its median is outside 2x; the language model
    is judged on its NLL and also shows its excess over the exact NLL; a model missing in one run is left out; the
    share of a run's NLL its worst sequences carry is shown where the runs recorded it."""
    runs = [tmp_path / f"seed-{k}" for k in range(5)]
    ar = [0.010, 0.012, 0.011, 0.044, 0.009]  # median 0.011: seed 3 is 4x it
    lang = [1.30, 1.20, 1.25, 1.40, 1.22]  # exact NLL 1.10: excess 0.20, 0.10, 0.15, 0.30, 0.12
    share = [0.31, 0.4, 0.35, 0.92, 0.5]  # seed 3's NLL: mostly its three worst problems
    for k, run in enumerate(runs):
        run.mkdir()
        models = {"gsm-ar": {"likelihood": {"nll_block_1": ar[k], "nll_lse": ar[k], "worst_sequences_share": share[k]}},
                  "lang-masked-mix": {"likelihood": {"nll_lse": lang[k], "nll_true": 1.10}}}
        if k:
            models["gsm-masked-mix"] = {"likelihood": {"nll_lse": 0.02}}
        (run / "summary.json").write_text(json.dumps({"models": models}))
    rows = {r["model"]: r for r in training_spread(runs)}
    assert set(rows) == {"gsm-ar", "lang-masked-mix"}
    assert rows["gsm-ar"]["median"] == 0.011 and rows["gsm-ar"]["worst_ratio"] == pytest.approx(4.0)
    assert not rows["gsm-ar"]["within"] and "excess" not in rows["gsm-ar"]
    assert rows["gsm-ar"]["share_worst"] == share and "share_worst" not in rows["lang-masked-mix"]
    assert rows["lang-masked-mix"]["worst_ratio"] == pytest.approx(1.40 / 1.25) and rows["lang-masked-mix"]["within"]
    assert rows["lang-masked-mix"]["excess"] == pytest.approx([0.20, 0.10, 0.15, 0.30, 0.12])
    assert rows["lang-masked-mix"]["excess_worst_ratio"] == pytest.approx(0.30 / 0.15)

    config = _Config(str(tmp_path), seeds=tuple(range(5)))
    write_training_spread(config, runs)
    printed = capsys.readouterr().out
    assert "OUTSIDE 2x" in printed and "within 2x" in printed and "4.00x" in printed
    assert "0.044" in printed and "0.011" in printed  # significant digits, so 1e-5 does not print as 0.0000
    assert "its 3 worst sequences carry 31%-92%" in printed
    rows = [{"model": "gsm-ar", "nll": [2.1e-5, 3.4e-6], "median": 1.2e-5, "worst_ratio": 1.75, "within": True}]
    assert "2.1e-05" in format_spread(rows) and "3.4e-06" in format_spread(rows)
    doc = json.loads((tmp_path / "training-spread.json").read_text())
    assert doc["seeds"] == [0, 1, 2, 3, 4] and [r["model"] for r in doc["models"]] == ["gsm-ar", "lang-masked-mix"]
