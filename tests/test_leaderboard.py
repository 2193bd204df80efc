"""Leaderboard JSON: schema validation, atomic writes, rows from a real `lm_eval` run, the paper's rows, plots."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.harness.reports import leaderboard as lb
from blockgen.harness.reports.leaderboard import Leaderboard, LeaderboardError, Row
from blockgen.models.sampler_config import SamplerConfig, paper_nfe_per_block
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]
PAPER_TEX = REPO.parent / "shared" / "paper" / "blockgen-paper.tex"
PY = sys.executable
BLOCKGEN = [PY, "-m", "blockgen.harness.cli"]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*BLOCKGEN, *map(str, args)], capture_output=True, text=True, timeout=HANG_S, cwd=cwd)


# ------------------------------------------------------------------------------ schema


def test_round_trip_keeps_every_field(tmp_path):
    row = Row(model="m", task="t", metric="exact_match", value=0.5, stderr=0.1, n=10, higher_is_better=True,
              prior="masked", block_sizes=[1, 16], block_weights=[0.05, 0.95], sampler="arpc", steps=3, ge=3,
              warmup=0, temperature=0.1, nfe_per_block=4, model_calls_per_block=4.0, total_calls=40, seed=0)
    lb.write(Leaderboard([row], "d", {"command": "c"}), tmp_path / "b.json")
    back = lb.read(tmp_path / "b.json")
    assert back.rows == [row] and back.description == "d" and back.provenance == {"command": "c"}


@pytest.mark.parametrize("text,message", [
    ('{"schema": ', r"not valid JSON \(line 1, column 12"),
    ('[]', "expected a JSON object"),
    ('{"schema": "other", "version": 1, "rows": []}', "expected 'blockgen-leaderboard'"),
    ('{"schema": "blockgen-leaderboard", "version": 99, "rows": []}', "version 99 is not supported"),
    ('{"schema": "blockgen-leaderboard", "version": 1}', r"\.rows: expected a list"),
    ('{"schema": "blockgen-leaderboard", "version": 1, "rows": [{"model": "m", "task": "t", "metric": "x"}]}',
     r"rows\[0\]: missing required field\(s\) \['value'\]"),
    ('{"schema": "blockgen-leaderboard", "version": 1, "rows": [{"model": "m", "task": "t", "metric": "x", "value": "high"}]}',
     r"rows\[0\]\.value: expected a number, got 'high'"),
    ('{"schema": "blockgen-leaderboard", "version": 1, "rows": [{"model": "m", "task": "t", "metric": "x", "value": 1, "nfe": 4}]}',
     r"unknown field\(s\) \['nfe'\]; valid fields"),
    ('{"schema": "blockgen-leaderboard", "version": 1, "rows": [{"model": "m", "task": "t", "metric": "x", "value": 1, "block_sizes": [1, "16"]}]}',
     r"block_sizes\[1\]: expected an integer"),
])
def test_malformed_files_give_one_clear_error(tmp_path, capsys, text, message):
    """The reader's error, and `blockgen leaderboard show`'s one line with exit status 2 (the command's code in this
    process; the real command line below)."""
    from blockgen.harness.cli import main

    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(LeaderboardError, match=message):
        lb.read(path)
    capsys.readouterr()
    assert main(["leaderboard", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1


def test_a_malformed_file_on_the_command_line_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"schema": "blockgen-leaderboard", "version": 1}')
    result = cli("leaderboard", "show", path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"\.rows: expected a list", result.stderr) and result.stderr.count("\n") == 1


def test_a_crash_while_writing_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "b.json"
    lb.write(Leaderboard([Row(model="m", task="t", metric="x", value=1.0)]), path)
    before = path.read_text()

    def dump_half_then_die(obj, f, **kwargs):
        f.write(json.dumps(obj)[:40])
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr(lb.json, "dump", dump_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        lb.write(Leaderboard([Row(model="m", task="t", metric="x", value=2.0)]), path)
    assert path.read_text() == before and os.listdir(tmp_path) == ["b.json"]


def test_best_per_nfe_keeps_one_variant_per_nfe_in_the_metric_direction():
    rows = [Row(model="m", task="t", metric="acc", value=v, higher_is_better=True, sampler="arpc", steps=s, ge=g,
                warmup=0, temperature=1.0, nfe_per_block=nfe)
            for v, s, g, nfe in ((0.2, 3, 3, 4), (0.3, 2, 1, 4), (0.5, 6, 3, 8))]
    rows += [Row(model="m", task="t", metric="ppl", value=v, higher_is_better=False, sampler="arpc", steps=s, ge=1,
                 warmup=0, temperature=1.0, nfe_per_block=8) for v, s in ((30.0, 4), (20.0, 5))]
    best = lb.best_per_nfe(lb.table(rows))
    assert sorted(zip(best.metric, best.nfe_per_block, best.value)) == [("acc", 4, 0.3), ("acc", 8, 0.5), ("ppl", 8, 20.0)]


# ------------------------------------------------------------------------------ from a real lm_eval run


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lb")


@pytest.fixture(scope="module")
def checkpoint(work, ci_checkpoint) -> Path:
    """A micro checkpoint, block sizes 1 and 4: a copy of the `ci` preset's (tests/shared_fixtures.py) in a run
    folder named `tiny-run`, the model's name in the rows."""
    shutil.copytree(ci_checkpoint, work / "tiny-run" / "checkpoint")
    return work / "tiny-run" / "checkpoint"


def lm_eval(work: Path, model_args: str, tasks: str, out: str, *extra: str) -> Path:
    """The real `lm_eval` command on the CPU (6 documents per task); its results file."""
    cmd = [PY, "-m", "lm_eval", "--model", "blockgen", "--model_args", model_args, "--tasks", tasks, "--device", "cpu",
           "--batch_size", "4", "--limit", "6", "--output_path", str(work / out), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (work / out).rglob("results_*.json")
    return path


@pytest.fixture(scope="module")
def results_file(work, checkpoint) -> Path:
    """The micro checkpoint evaluated on two toy tasks."""
    return lm_eval(work, f"pretrained={checkpoint},sampler=arpc,steps=3,ge=3,temperature=0.5,k_mc=2",
                   "blockgen_toy_gen,blockgen_toy_ppl", "results")


def test_blockgen_leaderboard_add_turns_lm_eval_results_into_rows(results_file, tmp_path):
    board = tmp_path / "board.json"
    out = cli("leaderboard", "add", results_file, "--to", board)
    assert out.returncode == 0, out.stderr
    results = json.loads(results_file.read_text())
    rows = {r.metric: r for r in lb.read(board).rows}
    gen = rows["exact_match"]
    assert (gen.model, gen.task, gen.value) == ("tiny-run", "blockgen_toy_gen", results["results"]["blockgen_toy_gen"]["exact_match,none"])
    assert (gen.sampler, gen.steps, gen.ge, gen.warmup, gen.temperature) == ("arpc", 3, 3, 0, 0.5)
    assert gen.nfe_per_block == paper_nfe_per_block(SamplerConfig("arpc", steps=3, ge=3)) == 4
    report = results["config"]["blockgen"]["tasks"]["blockgen_toy_gen"]["generate_until"]
    assert gen.total_calls == report["model_calls"] > 0 and gen.model_calls_per_block is not None
    assert gen.n == 6 and gen.train_steps == 40 and gen.checkpoint_sha == results["config"]["model_sha"]
    assert gen.lm_eval_version == results["lm_eval_version"] and gen.wall_seconds > 0 and gen.tokens_per_s > 0
    # Decoding speed counts the time inside the sampler, not the whole run (loading, scoring).
    assert 0 < report["generate_seconds"] < gen.wall_seconds
    assert gen.tokens_per_s == pytest.approx(report["generated_tokens"] / report["generate_seconds"])
    ppl = rows["word_perplexity"]
    assert ppl.sampler is None and ppl.k_mc == 2 and ppl.higher_is_better is False and ppl.stderr is None
    assert {"byte_perplexity", "bits_per_byte"} <= rows.keys()
    again = cli("leaderboard", "add", results_file, "--to", board)  # the same results again replace, never duplicate
    assert "4 replaced" in again.stdout and len(lb.read(board).rows) == len(rows)
    shown = cli("leaderboard", "show", board, "--task", "blockgen_toy_gen")
    assert shown.returncode == 0 and "arpc" in shown.stdout and "word_perplexity" not in shown.stdout


CACHED_ARGS = "sampler=arpc,steps=3,ge=3,k_mc=2,seed=3"


@pytest.fixture(scope="module")
def cached_reruns(work, checkpoint) -> list[Path]:
    """One `lm_eval --use_cache` command run twice: the second time lm-eval's cache answers every request
    it can (owt_ppl's windows are never cached: they run again)."""
    args = ("--use_cache", str(work / "lm-eval-cache"), "--log_samples")
    tasks = "blockgen_toy_gen,blockgen_toy_cloze,owt_ppl_embedded"
    return [lm_eval(work, f"pretrained={checkpoint},{CACHED_ARGS}", tasks, run, *args) for run in ("first", "again")]


def test_a_cached_rerun_gives_the_same_rows(cached_reruns, tmp_path):
    """Nothing reaches the model the second time, yet its rows keep the block size, calls and tokens/s:
    the usage the first run stored beside lm-eval's cache (issue 28)."""
    boards = []
    for i, path in enumerate(cached_reruns):
        out = cli("leaderboard", "add", path, "--to", tmp_path / f"{i}.json")
        assert out.returncode == 0, out.stderr
        boards.append(sorted(lb.read(tmp_path / f"{i}.json").rows, key=lambda r: (r.task, r.metric)))
    first, again = ([replace(r, source="", date=None, wall_seconds=None) for r in rows] for rows in boards)
    assert first == again
    gen = next(r for r in boards[1] if r.task == "blockgen_toy_gen")
    assert (gen.sampler, gen.block_size, gen.nfe_per_block, gen.model_calls_per_block) == ("arpc", 4, 4, 4.0)
    assert gen.total_calls > 0 and gen.tokens_per_s > 0
    reports = [json.loads(path.read_text())["config"]["blockgen"]["tasks"] for path in cached_reruns]
    for task, kind in (("blockgen_toy_gen", "generate_until"), ("blockgen_toy_cloze", "loglikelihood")):
        assert "answered_from_cache" not in reports[0][task][kind]
        assert reports[1][task][kind] == {**reports[0][task][kind], "answered_from_cache": 6, "usage_from_cache": True}
    # answers from the cache without their stored usage: a count of the rest is not the task's total
    results = json.loads(cached_reruns[1].read_text())
    results["config"]["blockgen"]["tasks"]["blockgen_toy_gen"]["generate_until"]["usage_from_cache"] = False
    partial = next(r for r in lb.rows_from_results(results) if r.task == "blockgen_toy_gen")
    assert partial.total_calls is None and partial.tokens_per_s == gen.tokens_per_s


def test_a_cached_subset_names_its_settings_and_measures_nothing(cached_reruns, work, checkpoint):
    """Fewer documents than the run that filled the cache: every answer is cached, but no usage was
    stored for this set of requests; the rows name the settings and leave calls and speed unmeasured."""
    import lm_eval as lm_eval_api
    from lm_eval.tasks import TaskManager

    from blockgen.lm_eval import tasks_dir

    out = lm_eval_api.simple_evaluate(model="blockgen", model_args=f"pretrained={checkpoint},{CACHED_ARGS}",
                                      tasks=["blockgen_toy_gen"], limit=4, device="cpu", batch_size=4, bootstrap_iters=0,
                                      use_cache=str(work / "lm-eval-cache"),
                                      task_manager=TaskManager(include_path=tasks_dir(), include_defaults=False))
    report = out["config"]["blockgen"]["tasks"]["blockgen_toy_gen"]["generate_until"]
    assert (report["requests"], report["answered_from_cache"], report["usage_from_cache"]) == (0, 4, False)
    (row,) = lb.rows_from_results(json.loads(json.dumps(out, default=str)))
    assert (row.sampler, row.steps, row.block_size, row.nfe_per_block) == ("arpc", 3, 4, 4)
    assert row.model_calls_per_block is None and row.total_calls is None and row.tokens_per_s is None


def test_compare_two_owt_ppl_runs_on_the_command_line(cached_reruns):
    """`blockgen leaderboard compare` pairs the chunks' NLLs of two real owt_ppl logs; the same settings
    score the same chunks to the same numbers, so the paired difference is exactly 0."""
    a, b = cached_reruns
    r = subprocess.run([*BLOCKGEN, "leaderboard", "compare", a, b, "--task", "owt_ppl_embedded", "--json"],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)
    nll = json.loads(a.read_text())["results"]["owt_ppl_embedded"]["nll,none"]  # lm-eval's own aggregate
    assert (c["metric"], c["n"]) == ("nll", 6) and c["value_a"] == pytest.approx(nll, rel=1e-12) and c["value_b"] == c["value_a"]
    assert (c["difference"], c["low"], c["high"], c["p_value"], c["resolved"]) == (0, 0, 0, 1, False)


def test_results_not_from_lm_eval_are_refused(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": {}, "config": {}}))
    out = cli("leaderboard", "add", path, "--to", tmp_path / "b.json")
    assert out.returncode == 2 and "not an lm-eval results file" in out.stderr


# ------------------------------------------------------------------------------ the paper's rows


def paper_rows() -> list[Row]:
    return lb.read(REPO / "leaderboards" / "paper.json").rows


def test_paper_rows_are_published_and_consistent():
    rows = paper_rows()
    assert rows and all(r.published and r.source.startswith("paper") for r in rows)
    arpc = [r for r in rows if r.sampler == "arpc"]
    assert len(arpc) == 240  # tables 5 and 8: (25 + 35 variants) x 2 temperatures x 2 priors
    for r in arpc:  # every ARPC label is the appendix's formula applied to (N_step, GE, warm-up)
        assert r.nfe_per_block == paper_nfe_per_block(SamplerConfig("arpc", steps=r.steps, ge=r.ge, warmup=r.warmup))
        assert r.block_sizes == [1, r.block_size] and r.block_weights == [0.05, 0.95]
    owt = {r.model: r.value for r in rows if r.task == "owt_ppl" and r.train_steps == 1_000_000}
    assert owt["owt-ar"] == 16.7 and owt["owt-masked-mix-flat"] == 17.5 and owt["owt-uniform-mix"] == 20.9


def _tex_table(label: str) -> list[tuple[int | None, list[str]]]:
    """(NFE group, cells) per data row of one of the paper's GSM8K tables (an independent reading)."""
    tex = PAPER_TEX.read_text()
    start = tex.index(f"\\label{{{label}}}")
    body = tex[tex.index("\\midrule", start) : tex.index("\\end{tabular}", start)]
    out, nfe = [], None
    for line in body.splitlines():
        if m := re.search(r"NFE\\,(\d+)", line):
            nfe = int(m.group(1))
        elif re.match(r"\s*\d", line):
            out.append((nfe, [c.strip() for c in line.strip().removesuffix("\\\\").split("&")]))
    return out


@pytest.mark.skipif(not PAPER_TEX.is_file(), reason="the paper (../shared/paper) is not beside this checkout")
@pytest.mark.parametrize("label,block", [("tab:arpc_variants_b16", 16), ("tab:arpc_variants_b32", 32)])
def test_paper_rows_match_the_tex_and_best_per_nfe_finds_the_bold_entries(label, block):
    """Every ARPC cell of tables 5 and 8 is stored, and best_per_nfe picks exactly the paper's bold cells."""
    columns = [(1.0, "masked"), (1.0, "uniform"), (0.1, "masked"), (0.1, "uniform")]
    stored = {(r.prior, r.temperature, r.steps, r.ge, r.warmup): r.value for r in paper_rows()
              if r.sampler == "arpc" and r.block_size == block}
    bold = set()
    for nfe, cells in _tex_table(label):
        steps, ge, warmup = map(int, cells[:3])
        for (temp, prior), cell in zip(columns, cells[3:]):
            value = float(re.sub(r"\\(textbf|underline)\{([^}]*)\}", r"\2", cell))
            assert stored[(prior, temp, steps, ge, warmup)] == pytest.approx(value / 100)
            if "textbf" in cell:
                bold.add((prior, temp, steps, ge, warmup))
    best = lb.best_per_nfe(lb.table([r for r in paper_rows() if r.sampler == "arpc" and r.block_size == block]))
    assert set(zip(best["prior"], best["temperature"], best["steps"], best["ge"], best["warmup"])) == bold


# ------------------------------------------------------------------------------ plots


def test_plot_writes_the_accuracy_and_genppl_figures(tmp_path):
    import matplotlib.image

    board = tmp_path / "ours.json"
    ours = [replace(r, published=False, model="ours", source="test", value=r.value * 0.9)
            for r in paper_rows() if r.sampler == "arpc" and r.block_size == 16]
    genppl = [Row(model="ours", task="owt_genppl", metric=metric, value=v, sampler="arpc", steps=6, ge=3, warmup=0,
                  temperature=t, nfe_per_block=8)
              for t, ppl, ent in ((0.7, 20.0, 4.9), (1.0, 60.0, 5.4)) for metric, v in (("gen_ppl", ppl), ("unigram_entropy", ent))]
    lb.write(Leaderboard(ours + genppl), board)
    out = cli("leaderboard", "plot", REPO / "leaderboards" / "paper.json", board, "--out-dir", tmp_path / "png")
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["accuracy_vs_nfe_gsm8k_code_b16.png", "accuracy_vs_nfe_gsm8k_code_b32.png", "genppl_vs_entropy_owt_genppl.png"]
    for name in names:
        image = matplotlib.image.imread(tmp_path / "png" / name)
        assert image.shape[0] > 300 and image.shape[1] > 500 and image[..., :3].std() > 0.05  # drawn, not blank


def test_settings_that_differ_only_in_their_budget_make_one_row():
    """gsm8k_code gives each row the room its prompt leaves: the adapter reports one settings record
    per budget; they merge (counts summed, calls per block recomputed), other settings stay apart."""
    from blockgen.harness.evaluation.lm_eval_model.usage import merge_budgets

    base = {"sampler": "arpc", "steps": 3, "ge": 2, "warmup": 1, "temperature": 0.1, "block_size": 16,
            "layout": "grid", "paper_nfe_per_block": 4}
    parts = [{**base, "max_gen_toks": 90, "requests": 3, "model_calls": 30, "blocks": 10, "generated_tokens": 150,
              "generate_seconds": 1.5, "model_calls_per_block": 3.0},
             {**base, "max_gen_toks": 75, "requests": 1, "model_calls": 12, "blocks": 2, "generated_tokens": 40,
              "generate_seconds": 0.5, "model_calls_per_block": 6.0}]
    (merged,) = merge_budgets(parts)
    assert merged["max_gen_toks"] == 90 and merged["requests"] == 4 and merged["model_calls"] == 42
    assert merged["blocks"] == 12 and merged["generated_tokens"] == 190 and merged["generate_seconds"] == 2.0
    assert merged["model_calls_per_block"] == 42 / 12
    assert merge_budgets(parts[:1]) == parts[:1]
    assert len(merge_budgets([parts[0], {**parts[1], "temperature": 1.0}])) == 2


def test_show_best_on_the_stored_demo_leaderboard_is_one_row_per_setting():
    """`show --best` keeps each task's headline metric (as the page does), missing values as empty cells, one
    printed row per setting; `--compact` is the README's table."""
    board = REPO / "leaderboards" / "embedded_demo.json"
    rows = lb.read(board).rows
    shown = cli("leaderboard", "show", board, "--best")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "NaN" not in shown.stdout and "<NA>" not in shown.stdout
    headline = lb.headline_rows(rows)
    assert {r.metric for r in headline} < {r.metric for r in rows}  # fewer metrics than stored
    settings = {(r.model, r.task, r.sampler, r.block_size, r.temperature, r.nfe_per_block) for r in headline}
    assert len(lines) - 1 == len(settings)  # a header, then one row per setting
    compact = cli("leaderboard", "show", board, "--best", "--compact").stdout.splitlines()
    assert compact[0].split() == ["model", "task", "metric", "sampler", "T", "NFE", "N/GE/W", "value", "calls/block", "tok/s"]
    assert len(compact) == len(lines)
    assert any("% +-" in line for line in compact[1:])  # accuracy as a percentage with its standard error
