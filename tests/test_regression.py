"""CI regression check: a rerun's leaderboard against a reference with tolerances (harness/reports/regression.py),
and the one command that tells this reference from an outcomes store (tests/test_outcomes.py checks that one).

Synthetic leaderboards written with the leaderboard module's own writer; the real CLI through subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from blockgen.harness.reports import leaderboard as lb
from blockgen.harness.reports import regression as rg
from blockgen.harness.cli import main as cli_main
from blockgen.harness.reports.leaderboard import Leaderboard, LeaderboardError, Row
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]
BLOCKGEN = [sys.executable, "-m", "blockgen.harness.cli"]

# A perplexity (lower is better) and an accuracy (higher is better), each with its stderr and tolerance.
PPL = Row(model="owt-embedded-ar", task="owt_ppl_embedded", metric="word_perplexity", value=120.0, stderr=5.0,
          higher_is_better=False, k_mc=2, train_steps=100, seed=0, checkpoint_sha="aaa", tolerance=10.0)
ACC = Row(model="gsm-masked-mix", task="gsm8k_code_embedded", metric="exact_match", value=0.40, stderr=0.02,
          higher_is_better=True, sampler="arpc", steps=6, ge=3, warmup=0, temperature=0.1, block_size=16,
          train_steps=100, seed=0, checkpoint_sha="bbb", tolerance=0.05)


def board(*rows: Row) -> Leaderboard:
    return Leaderboard(list(rows), "test", {"command": "test"})


def rerun(row: Row, value: float) -> Row:
    """The same measurement from a rerun: a new value, no tolerance, another checkpoint hash and date."""
    return replace(row, value=value, tolerance=None, checkpoint_sha="ccc", date="2026-11-27T00:00:00+00:00")


def files(tmp_path: Path, reference: Leaderboard, new: Leaderboard) -> tuple[Path, Path]:
    lb.write(reference, tmp_path / "reference.json")
    lb.write(new, tmp_path / "new.json")
    return tmp_path / "new.json", tmp_path / "reference.json"


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*BLOCKGEN, *map(str, args)], capture_output=True, text=True, timeout=HANG_S)


def verdicts(new: Leaderboard) -> dict[str, str]:
    return {c.row.metric: c.verdict for c in rg.compare(board(PPL, ACC), new)}


# ------------------------------------------------------------------------------ verdicts


def test_identical_rerun_passes(tmp_path):
    new, ref = files(tmp_path, board(PPL, ACC), board(rerun(PPL, PPL.value), rerun(ACC, ACC.value)))
    passed, text = rg.check(new, ref)
    assert passed and "passed" in text.splitlines()[0]
    assert text.splitlines()[-1] == "2 same (of 2 rows)"  # no table: nothing to show


def test_moves_within_tolerance_pass_either_way():
    assert verdicts(board(rerun(PPL, 120.0 + 9.9), rerun(ACC, 0.40 - 0.049))) == {"word_perplexity": "ok", "exact_match": "ok"}
    assert verdicts(board(rerun(PPL, 120.0 - 10.0), rerun(ACC, 0.40 + 0.05))) == {"word_perplexity": "ok", "exact_match": "ok"}


@pytest.mark.parametrize("ppl, acc, expected", [
    (131.0, 0.40, {"word_perplexity": "WORSE", "exact_match": "same"}),   # perplexity up is worse
    (120.0, 0.34, {"word_perplexity": "same", "exact_match": "WORSE"}),   # accuracy down is worse
    (109.0, 0.46, {"word_perplexity": "better", "exact_match": "better"}),  # the other way round is better
])
def test_direction_of_worse_comes_from_the_metric(ppl, acc, expected):
    assert verdicts(board(rerun(PPL, ppl), rerun(ACC, acc))) == expected


def test_worse_metric_fails_with_a_readable_diff_table(tmp_path):
    new, ref = files(tmp_path, board(PPL, ACC), board(rerun(PPL, 135.0), rerun(ACC, 0.40)))
    passed, text = rg.check(new, ref)
    assert not passed and "FAILED" in text.splitlines()[0]
    header, row = text.splitlines()[1:3]
    assert header.split() == ["verdict", "metric", "settings", "stored", "new", "change", "tolerance"]
    assert row.split()[:3] == ["WORSE", "owt_ppl_embedded/word_perplexity", "owt-embedded-ar"]
    assert "120" in row and "135" in row and "+15 (+12.5%)" in row and "±10" in row
    assert "exact_match" not in text  # rows within tolerance stay out of the table
    assert "1 same, 1 WORSE (of 2 rows)" in text and "make regression-update" in text


def test_better_metric_is_reported_without_failing(tmp_path):
    new, ref = files(tmp_path, board(PPL, ACC), board(rerun(PPL, 120.0), rerun(ACC, 0.55)))
    passed, text = rg.check(new, ref)
    assert passed
    assert "better" in text and "0.4" in text and "0.55" in text and "+0.15 (+37.5%)" in text
    assert "make regression-update" in text  # the hint to store the improvement


def test_missing_row_fails_and_extra_row_is_reported(tmp_path):
    extra = rerun(replace(ACC, temperature=1.0), 0.3)
    new, ref = files(tmp_path, board(PPL, ACC), board(rerun(PPL, 120.0), extra))
    passed, text = rg.check(new, ref)
    assert not passed
    kinds = {c.verdict: c for c in rg.compare(board(PPL, ACC), board(rerun(PPL, 120.0), extra))}
    assert set(kinds) == {"same", "MISSING", "extra"}
    assert kinds["MISSING"].stored == ACC and kinds["extra"].new == extra
    assert "MISSING" in text and "extra" in text and "T=0.1" in text and "T=1" in text
    # an extra row alone does not fail
    new, ref = files(tmp_path, board(PPL), board(rerun(PPL, 120.0), extra))
    assert rg.check(new, ref)[0]


def test_metric_without_direction_fails_past_tolerance_either_way():
    stored = replace(PPL, higher_is_better=None)
    for value in (131.0, 109.0):
        (c,) = rg.compare(board(stored), board(rerun(stored, value)))
        assert c.verdict == "MOVED" and c.fails


def test_nan_is_worse_than_a_number():
    (c,) = rg.compare(board(PPL), board(rerun(PPL, math.nan)))
    assert c.verdict == "WORSE"


def test_rows_match_by_the_leaderboard_key_without_the_checkpoint_hash():
    assert rg.match_key(PPL) == rg.match_key(rerun(PPL, 1.0))  # retraining changes the hash, not the measurement
    assert rg.match_key(PPL) != rg.match_key(replace(PPL, k_mc=4))
    assert rg.match_key(ACC) != rg.match_key(replace(ACC, steps=3))


def test_duplicate_rows_are_an_error_not_a_guess():
    with pytest.raises(LeaderboardError, match="two rows for owt_ppl_embedded/word_perplexity"):
        rg.compare(board(PPL), board(rerun(PPL, 1.0), replace(rerun(PPL, 2.0), checkpoint_sha="ddd")))


# ------------------------------------------------------------------------------ tolerances


def test_tolerance_rule():
    # the spread term: k * relative range * |value|; the stderr term: z * sqrt(2) * stderr
    assert rg.tolerance(replace(PPL, stderr=None), 0.05, k=3, z=3.5) == pytest.approx(3 * 0.05 * 120.0)
    assert rg.tolerance(PPL, 0.0, k=3, z=3.5) == pytest.approx(3.5 * math.sqrt(2) * 5.0)
    assert rg.tolerance(PPL, 0.1, k=3, z=3.5) == pytest.approx(max(36.0, 3.5 * math.sqrt(2) * 5.0))


def test_relative_spread_is_the_largest_range_per_metric_across_seeds():
    runs = [board(replace(PPL, value=v, seed=seed), replace(ACC, value=a, seed=seed), replace(PPL, value=v + 60, k_mc=4, seed=seed))
            for seed, (v, a) in enumerate(((100.0, 0.4), (104.0, 0.4), (98.0, 0.4)))]
    spread = rg.relative_spread(runs)  # rows match across runs with other seeds
    # word_perplexity: range 6 around 100.7 (K_MC=2) beats range 6 around 160.7 (K_MC=4); exact_match: identical
    assert spread == {"owt_ppl_embedded/word_perplexity": pytest.approx(6 / (302 / 3)),
                      "gsm8k_code_embedded/exact_match": 0.0}
    with pytest.raises(LeaderboardError, match="missing from some of the runs"):
        rg.relative_spread([*runs, board(PPL)])


def test_update_measures_the_spread_then_keeps_the_policy(tmp_path):
    runs = []
    for i, (v, a) in enumerate(((100.0, 0.40), (104.0, 0.40), (98.0, 0.40))):
        lb.write(board(rerun(PPL, v), rerun(ACC, a)), tmp_path / f"run{i}.json")
        runs.append(tmp_path / f"run{i}.json")
    ref = tmp_path / "ci_regression.json"
    assert cli_main(["regression", "update", *map(str, runs), "--to", str(ref), "--spread-note", "3 runs"]) == 0
    stored = lb.read(ref)
    policy = stored.provenance["tolerance"]
    assert policy["k"] == rg.DEFAULT_K and policy["z"] == rg.DEFAULT_Z and policy["spread_runs"] == 3
    assert {"command", "commit", "date", "machine"} <= set(stored.provenance)
    ppl, acc = stored.rows
    assert ppl.value == 100.0 and ppl.tolerance == pytest.approx(max(3 * 6 / (302 / 3) * 100.0, 3.5 * math.sqrt(2) * 5.0))
    assert acc.tolerance == pytest.approx(3.5 * math.sqrt(2) * 0.02)  # no spread: the stderr term
    # the stored reference passes against its own run
    assert rg.check(runs[0], ref)[0]
    # one new leaderboard: the stored spread and factors are kept, the tolerance follows the new stderr
    lb.write(board(rerun(replace(PPL, stderr=1.0), 110.0), rerun(ACC, 0.5)), tmp_path / "new.json")
    assert cli_main(["regression", "update", str(tmp_path / "new.json"), "--to", str(ref)]) == 0
    again = lb.read(ref)
    assert again.provenance["tolerance"]["relative_spread"] == policy["relative_spread"]
    assert again.rows[0].value == 110.0 and again.rows[0].tolerance == pytest.approx(3 * 6 / (302 / 3) * 110.0)


def test_update_refuses_a_metric_without_measured_spread(tmp_path, capsys):
    lb.write(board(rerun(PPL, 1.0), rerun(ACC, 0.5)), tmp_path / "a.json")
    lb.write(board(rerun(PPL, 1.0)), tmp_path / "b.json")
    assert cli_main(["regression", "update", str(tmp_path / "b.json"), str(tmp_path / "b.json"), "--to", str(tmp_path / "ref.json")]) == 0
    assert cli_main(["regression", "update", str(tmp_path / "a.json"), "--to", str(tmp_path / "ref.json")]) == 2
    assert "no measured run-to-run spread for ['gsm8k_code_embedded/exact_match']" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the real command line


def test_blockgen_leaderboard_check_exit_codes(tmp_path):
    reference = board(PPL, ACC)
    new, ref = files(tmp_path, reference, board(rerun(PPL, 120.0), rerun(ACC, 0.41)))
    ok = cli("leaderboard", "check", new, "--against", ref)
    assert ok.returncode == 0, ok.stderr
    assert "passed" in ok.stdout and "1 same, 1 ok (of 2 rows)" in ok.stdout
    listed = cli("leaderboard", "check", new, "--against", ref, "--all")
    assert listed.returncode == 0 and "exact_match" in listed.stdout and "+0.01 (+2.5%)" in listed.stdout

    lb.write(board(rerun(PPL, 120.0), rerun(ACC, 0.30)), new)
    worse = cli("leaderboard", "check", new, "--against", ref)
    assert worse.returncode == 1 and "WORSE" in worse.stdout and "gsm8k_code_embedded/exact_match" in worse.stdout

    lb.write(board(rerun(PPL, 120.0)), new)
    missing = cli("leaderboard", "check", new, "--against", ref)
    assert missing.returncode == 1 and "MISSING" in missing.stdout

    (tmp_path / "broken.json").write_text(json.dumps({"schema": "blockgen-leaderboard", "version": 1, "rows": [{"model": "m"}]}))
    broken = cli("leaderboard", "check", tmp_path / "broken.json", "--against", ref)
    assert broken.returncode == 2 and "missing required field(s)" in broken.stderr and not broken.stdout


def test_the_reference_decides_the_comparison(tmp_path):
    """A .json leaderboard is a leaderboard reference; a folder, or its outcomes.json, an outcomes store;
    a path not written yet (`update` creates it) is a store unless it ends in .json."""
    store = REPO / "leaderboards" / "ci_gsm8k"
    assert rg.reference_kind(REPO / rg.REFERENCE) == (rg.LEADERBOARD, REPO / rg.REFERENCE)
    assert rg.reference_kind(store) == rg.reference_kind(store / "outcomes.json") == (rg.OUTCOMES, store)
    assert rg.reference_kind(tmp_path / "new.json") == (rg.LEADERBOARD, tmp_path / "new.json")
    assert rg.reference_kind(tmp_path / "new-store") == (rg.OUTCOMES, tmp_path / "new-store")
    (tmp_path / "copy.json").write_text((store / "outcomes.json").read_text())
    with pytest.raises(ValueError, match="give the store's folder"):
        rg.reference_kind(tmp_path / "copy.json")


@pytest.mark.parametrize("argv, takes, misfits", [
    (["check", "--against", rg.REFERENCE, "--results", "DIR"], "NEW.json, --all", "--results is for an outcomes store "
     "(e.g. --against leaderboards/ci_gsm8k)"),
    (["check", "--against", "STORE", "new.json", "--all"], "--results, --out-dir, --no-progress, --runs, --alpha",
     "NEW.json, --all are for a leaderboard reference (e.g. --against leaderboards/ci_regression.json)"),
    (["update", "--to", "STORE", "new.json", "--k", "3"], "--results, --out-dir, --no-progress, --limit, --checkpoint, --dtype",
     "NEW.json, --k are for a leaderboard reference (e.g. --to leaderboards/ci_regression.json)"),
    (["update", "--to", "ref.json", "new.json", "--checkpoint", "DIR"], "NEW.json, --k, --z, --spread-note",
     "--checkpoint is for an outcomes store (e.g. --to leaderboards/ci_gsm8k)"),
])
def test_arguments_of_the_other_kind_are_an_error_naming_the_right_ones(tmp_path, capsys, argv, takes, misfits):
    """Refused before anything runs or is written: the error names what this reference takes."""
    (tmp_path / "STORE").mkdir()
    argv = [str(tmp_path / a) if a in ("STORE", "ref.json") else a for a in argv]
    assert cli_main(["regression", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockgen regression: error: ") and f"which takes {takes}; {misfits}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["STORE"] and not any((tmp_path / "STORE").iterdir())


def test_a_leaderboard_reference_needs_the_new_leaderboard(capsys):
    for action in ("check", "update"):
        assert cli_main(["regression", action]) == 2
        assert "is a leaderboard reference: give the new leaderboard, NEW.json" in capsys.readouterr().err


def test_stored_reference_is_valid_and_every_row_has_a_tolerance():
    stored = lb.read(REPO / rg.REFERENCE)
    assert stored.rows and all(r.tolerance is not None and r.tolerance >= 0 for r in stored.rows)
    assert {"command", "commit", "date", "machine", "tolerance"} <= set(stored.provenance)
    assert set(stored.provenance["tolerance"]["relative_spread"]) == {rg.metric_name(r) for r in stored.rows}
    assert rg.compare(stored, stored)  # one row per measurement: no duplicate keys


def test_make_regression_update_from_a_runs_folder_rewrites_the_reference(tmp_path):
    """The documented update command, end to end without training: FROM=<RUNS folder> stores its leaderboard."""
    reference = tmp_path / "ci_regression.json"
    reference.write_text((REPO / rg.REFERENCE).read_text())
    stored = lb.read(reference)
    (tmp_path / "run").mkdir()
    lb.write(board(*[rerun(r, r.value * 1.1) for r in stored.rows]), tmp_path / "run" / "leaderboard-owt-embedded.json")
    out = subprocess.run(["make", "-o", "setup", "regression-update", f"FROM={tmp_path / 'run'}", f"CI_REFERENCE={reference}",
                          f"PY={sys.executable}"], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the new rows against the old reference" in out.stdout and f"{len(stored.rows)} rows written" in out.stdout
    updated = lb.read(reference)
    spread = stored.provenance["tolerance"]["relative_spread"]
    assert updated.provenance["tolerance"]["relative_spread"] == spread  # the policy is kept
    assert f"RUNS={tmp_path / 'run'}" in updated.provenance["command"]
    for old, new in zip(stored.rows, updated.rows):
        assert new.value == pytest.approx(old.value * 1.1)
        assert new.tolerance == pytest.approx(rg.tolerance(new, spread[rg.metric_name(new)], rg.DEFAULT_K, rg.DEFAULT_Z))
    assert rg.check(tmp_path / "run" / "leaderboard-owt-embedded.json", reference)[1].splitlines()[-1] == f"{len(stored.rows)} same (of {len(stored.rows)} rows)"
