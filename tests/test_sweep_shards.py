"""A sweep over several jobs (harness/evaluation/sweep.py): `--shard I/N`, `--keep-going`, rank 0's skip decisions,
and `blockgen leaderboard collect` (harness/reports/leaderboard.py).

- The split: every setting in exactly one shard, the same split every time, balanced by priced cost
  (largest minus smallest load at most the costliest setting: the greedy bound), on every grid's priced
  costs and on random costs; unpriced settings count as the median price; a bad --shard is one line
  naming the form; the shards' dry runs together list the grid's settings once each.
- One grid as 3 shards in 3 processes at once (no process group) into one results root: the union is
  the unsharded sweep's row for row, and any job's rerun skips it all.
- A sweep made to stop mid-way and rerun runs only what it had not finished.
- --keep-going: a failing setting leaves error.json, the others run, exit 1 and the summary names it; a
  rerun retries only it. Without --keep-going the sweep stops at it, recorded.
- Under torchrun rank 0 decides what is done: a fake broadcast, and 2 gloo processes that see different
  results folders and still agree (nothing to run, no model loaded on either).
- collect fails on a measurement found twice with other values; `make eval-owt SHARDS=N`.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from blockgen.harness import cli
from blockgen.harness.reports import leaderboard
from blockgen.harness.evaluation import sweep
from blockgen.harness.runtime.distributed import decided_on_rank0
from blockgen.harness.costs.eval_cost import Price
from blockgen.harness.evaluation.grids import GRIDS
from blockgen.harness.evaluation import pricing
from blockgen.harness.evaluation.pricing import Shard, priced, split
from blockgen.harness.evaluation.evaluations import evaluations
from blockgen.harness.evaluation.sweep import SweepConfig, run_sweep
from limits import HANG_S
from test_sweep import BIN, ENV, REPO, work  # noqa: F401  (work: the trained micro mixture and scorer)

# ------------------------------------------------------------------------------ the split


def loads(costs: list[float], owner: list[int], count: int) -> list[float]:
    out = [0.0] * count
    for c, k in zip(costs, owner):
        out[k] += c
    return out


def check_split(costs: list[float], count: int) -> list[int]:
    owner = split(costs, count)
    assert owner == split(list(costs), count)  # deterministic
    assert len(owner) == len(costs) and all(0 <= k < count for k in owner)  # each setting in exactly one shard
    if costs:
        load = loads(costs, owner, count)
        assert max(load) - min(load) <= max(costs) * (1 + 1e-9)  # greedy to the least loaded: the bound
        if len(costs) >= count and min(costs) > 0:
            assert set(owner) == set(range(count))  # no idle job
    return owner


def test_split_is_deterministic_and_balanced_on_random_costs():
    rng = random.Random(0)
    for _ in range(300):
        n, count = rng.randint(0, 40), rng.randint(1, 9)
        costs = [rng.choice([rng.random() * 100, rng.randint(1, 4), 0.0]) for _ in range(n)]
        check_split(costs, count)
    # equal costs: the grid's order, round robin over the shards
    assert split([1.0] * 7, 3) == [0, 1, 2, 0, 1, 2, 0]
    # longest first: one big setting alone, the small ones beside it
    assert split([1, 1, 1, 3], 2) == [1, 1, 1, 0]


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_split_is_balanced_on_every_grids_priced_costs(name):
    g = GRIDS[name]
    todo = evaluations(g, "/nonexistent")
    costs = priced(g, todo)
    assert len(costs) == len(todo) and all(c > 0 for c in costs)
    for count in (2, 3, 8):
        check_split(costs, count)


def test_an_unpriced_setting_counts_as_the_median_price(monkeypatch):
    g = GRIDS["owt-embedded"]
    todo = evaluations(g, "/nonexistent")[:5]
    prices = iter([None, 1.0, 2.0, None, 10.0])
    monkeypatch.setattr(pricing, "estimate", lambda *args: Price(next(prices), ""))
    assert priced(g, todo) == [2.0, 1.0, 2.0, 2.0, 10.0]
    monkeypatch.setattr(pricing, "estimate", lambda *args: Price(None, ""))
    assert priced(g, todo) == [1.0] * 5  # nothing priced: every setting counts the same


@pytest.mark.parametrize("bad", ["3/3", "1", "a/b", "-1/2", "0/0", "1/2/3"])
def test_a_bad_shard_is_one_line_naming_the_form(bad, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["sweep", "owt-embedded", "--dry-run", f"--shard={bad}"])
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert f"argument --shard: {bad!r}: expected I/N" in line and "0 <= I < N" in line
    with pytest.raises(ValueError, match="expected I/N"):
        Shard(2, 2)


def dry_run_lines(*args: str) -> list[str]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["sweep", *args, "--dry-run"]) == 0
    return out.getvalue().splitlines()


@pytest.mark.parametrize("name", ["owt-embedded", "gsm8k"])
def test_the_shards_dry_runs_list_the_grids_settings_once(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no runs/gpu-check/rates.json: unsharded too, the stored rates, as the shards

    def setting_lines(lines):
        return [line for line in lines if not line.startswith(("#", "total:"))]

    whole = setting_lines(dry_run_lines(name))
    parts = [dry_run_lines(name, "--shard", f"{i}/3") for i in range(3)]
    assert sorted(line for p in parts for line in setting_lines(p)) == sorted(whole)
    for i, p in enumerate(parts):
        assert p[0].startswith(f"# shard {i}/3: {len(setting_lines(p))} of the grid's {len(whole)} settings")
        assert p[-1].startswith(f"total: {len(setting_lines(p))} settings")  # this shard's cost only


# ------------------------------------------------------------------------------ real runs


def sweep_args(work: Path, out: Path) -> list[str]:
    """A 3-setting grid on the micro mixture: likelihood and ARPC at two temperatures."""
    metadata = {"scorer": "transformers", "scorer_model": str(work / "scorer"), "num_samples": 2}
    return ["sweep", "owt-embedded", "--runs", str(work / "runs"), "--models", "mix", "--temperatures", "0.8", "1.2",
            "--limit", "2", "--k-mc", "1", "--metadata", json.dumps(metadata), "--no-progress", "--out-dir", str(out)]


def config(work: Path, out: Path, **kw) -> SweepConfig:
    args = cli.build_parser().parse_args(sweep_args(work, out))
    return replace(sweep.config_from_args(args), **kw)


def summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1].removeprefix("sweep: "))


def sweep_cli(*args: str) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(args))
    return code, summary(out.getvalue()), err.getvalue()


@pytest.fixture(scope="module")
def whole(work) -> Path:
    """The grid run unsharded, in this process."""
    out = work / "whole"
    code, report, _ = sweep_cli(*sweep_args(work, out))
    assert code == 0 and (report["ran"], report["failed"], report["shard"]) == (3, [], None)
    return out


def comparable(rows: list[leaderboard.Row]) -> dict[tuple, dict]:
    """Rows by key without what differs between two runs of the same setting (file, date, timing)."""
    drop = ("source", "date", "wall_seconds", "tokens_per_s")
    return {r.key(): {k: v for k, v in asdict(r).items() if k not in drop} for r in rows}


def test_three_shards_in_three_processes_equal_the_whole_sweep(work, whole):
    out = work / "shards"
    procs = [subprocess.Popen([str(BIN / "blockgen"), *sweep_args(work, out), "--shard", f"{i}/3"], cwd=REPO, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, stderr[-3000:]
        reports.append(summary(stdout))
    assert [r["shard"] for r in reports] == ["0/3", "1/3", "2/3"]
    assert [(r["settings"], r["ran"], r["skipped"], r["model_loads"]) for r in reports] == [(1, 1, 0, 1)] * 3
    # the same results folders as the whole sweep: its rerun on the shards' root skips everything
    again = run_sweep(config(work, out, progress=False))
    assert (again.ran, again.skipped, again.model_loads) == (0, 3, 0)
    rows, files = leaderboard.collect([out])
    whole_rows, whole_files = leaderboard.collect([whole])
    assert files == whole_files == 3 and len(rows) == len(whole_rows) > 3
    assert comparable(rows) == comparable(whole_rows)  # row for row
    # collect builds what `add` builds from the same files (the Makefile's leaderboard step moved to collect)
    board = leaderboard.Leaderboard([])
    leaderboard.add_results(sorted(out.rglob("results_*.json")), board)
    assert board.rows == rows
    # the command: one board from the shards' root
    assert cli.main(["leaderboard", "collect", str(out), "--to", str(work / "board.json")]) == 0
    assert comparable(leaderboard.read(work / "board.json").rows) == comparable(whole_rows)


def test_collect_fails_on_a_measurement_found_twice_with_other_values(whole, tmp_path, capsys):
    first = sorted(whole.rglob("results_*.json"))[0]
    copy = tmp_path / "other" / first.relative_to(whole)
    copy.parent.mkdir(parents=True)
    shutil.copy(first, copy)
    rows, files = leaderboard.collect([whole, tmp_path / "other"])  # the same numbers twice: one row each
    assert files == 4 and len(rows) == len(leaderboard.collect([whole])[0])
    results = json.loads(copy.read_text())
    task = next(iter(results["results"]))
    metric = next(k for k, v in results["results"][task].items() if "," in k and "_stderr" not in k and isinstance(v, float))
    results["results"][task][metric] += 1.0
    copy.write_text(json.dumps(results))
    with pytest.raises(leaderboard.LeaderboardError, match="disagrees") as err:
        leaderboard.collect([whole, tmp_path / "other"])
    assert str(first) in str(err.value) and str(copy) in str(err.value)
    assert cli.main(["leaderboard", "collect", str(whole), str(tmp_path / "other"), "--to", str(tmp_path / "b.json")]) == 2
    assert "disagrees" in capsys.readouterr().err and not (tmp_path / "b.json").exists()
    with pytest.raises(leaderboard.LeaderboardError, match="no results folder"):
        leaderboard.collect([tmp_path / "nowhere"])


def test_a_shard_stopped_midway_reruns_only_what_it_had_not_finished(work, monkeypatch):
    out = work / "stopped"
    sizes = {s: run_sweep(config(work, out, shard=s, dry_run=True)).settings for s in (Shard(0, 2), Shard(1, 2))}
    shard, mine = max(sizes.items(), key=lambda item: item[1])  # the shard with 2 of the 3 settings
    assert sorted(sizes.values()) == [1, 2]
    real, calls = sweep._evaluate, []

    def stop_at_the_second(s, *args, **kw):
        calls.append(s.label)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C, or the job's time ran out
        return real(s, *args, **kw)

    monkeypatch.setattr(sweep, "_evaluate", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config(work, out, shard=shard, progress=False))
    monkeypatch.setattr(sweep, "_evaluate", real)
    assert len(list(out.rglob("results_*.json"))) == 1 and not list(out.rglob(sweep.ERROR_FILE))  # stopped, not failed
    again = run_sweep(config(work, out, shard=shard, progress=False))
    assert (again.settings, again.ran, again.skipped, again.failed) == (mine, mine - 1, 1, [])
    assert len(list(out.rglob("results_*.json"))) == mine  # the other shard's settings are not run here


def test_keep_going_records_a_failure_runs_the_others_and_a_rerun_retries_it(work, monkeypatch):
    out = work / "failing"
    real = sweep._evaluate

    def broken_likelihood(s, *args, **kw):
        if s.sampler is None:
            raise RuntimeError("broken on purpose")
        return real(s, *args, **kw)

    monkeypatch.setattr(sweep, "_evaluate", broken_likelihood)
    code, report, err = sweep_cli(*sweep_args(work, out), "--keep-going")
    assert code == 1  # a failure is an error exit; 2 stays the usage errors'
    assert (report["ran"], report["failed"]) == (2, ["owt-embedded-mix/likelihood"])  # the likelihood runs first
    assert "1 of 3 settings failed" in err and "owt-embedded-mix/likelihood" in err
    folder = out / "owt-embedded-mix" / "likelihood"
    record = json.loads((folder / sweep.ERROR_FILE).read_text())
    assert record["error"] == "RuntimeError: broken on purpose"
    assert "broken_likelihood" in record["traceback"] and record["blockgen_sweep"]["limit"] == 2
    assert not list(folder.rglob("results_*.json")) and len(list(out.rglob("results_*.json"))) == 2

    monkeypatch.setattr(sweep, "_evaluate", real)
    code, report, _ = sweep_cli(*sweep_args(work, out), "--keep-going")
    assert code == 0 and (report["ran"], report["skipped"], report["failed"]) == (1, 2, [])  # only the failed one
    assert not (folder / sweep.ERROR_FILE).exists() and len(list(folder.rglob("results_*.json"))) == 1

    # without --keep-going: today's stop at the first failure, now recorded
    monkeypatch.setattr(sweep, "_evaluate", broken_likelihood)
    stop = work / "failing-stop"
    with pytest.raises(RuntimeError, match="broken on purpose"):
        run_sweep(config(work, stop, progress=False))
    assert (stop / "owt-embedded-mix" / "likelihood" / sweep.ERROR_FILE).is_file()
    assert not list(stop.rglob("results_*.json"))  # nothing after it ran


# ------------------------------------------------------------------------------ rank 0 decides


class FakeGroup:
    """torch.distributed as a rank of a 2-process group sees it; the broadcast hands out rank 0's value."""

    def __init__(self, monkeypatch, rank: int, rank0_value) -> None:
        import torch.distributed as dist

        self.sent: list = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist, "get_rank", lambda: rank)

        def broadcast_object_list(box, src):
            assert src == 0
            self.sent.append(list(box))
            box[0] = box[0] if rank == 0 else rank0_value

        monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)


def test_rank0_decides_and_every_rank_follows(monkeypatch):
    asked = []

    def decide():
        asked.append(1)
        return [True, False]

    assert decided_on_rank0(decide) == [True, False] and len(asked) == 1  # no group: decided here
    group = FakeGroup(monkeypatch, rank=1, rank0_value=[False, False])
    assert decided_on_rank0(decide) == [False, False] and len(asked) == 1  # rank 1 never reads its files
    assert group.sent == [[None]]
    group = FakeGroup(monkeypatch, rank=0, rank0_value=None)
    assert decided_on_rank0(decide) == [True, False] and len(asked) == 2 and group.sent == [[[True, False]]]


RANK_SCRIPT = """
import json, os, sys
from dataclasses import replace
from blockgen.harness import cli
from blockgen.harness.evaluation import sweep
from blockgen.harness.runtime.distributed import setup_distributed

setup_distributed("cpu", timeout_s=60)  # a short timeout: ranks that disagreed would wait in different collectives
args = cli.build_parser().parse_args(json.loads(sys.argv[1]))
out = sys.argv[2] + "/rank" + os.environ["RANK"]  # no shared file system: each rank its own results folder
report = sweep.run_sweep(replace(sweep.config_from_args(args), out_dir=out))
# a file per rank: two ranks printing at once can run their lines together on the shared stdout
with open(sys.argv[2] + "/report-rank" + os.environ["RANK"] + ".json", "w") as f:
    json.dump(report.__dict__, f)
import torch.distributed
torch.distributed.destroy_process_group()
"""


@pytest.mark.whole_machine
def test_two_gloo_ranks_that_see_different_folders_follow_rank0(work, whole, tmp_path):
    """Rank 0's folder holds every result, rank 1's is empty: both skip everything (rank 1 deciding on
    its own would load the model and run alone until the timeout)."""
    shutil.copytree(whole, tmp_path / "rank0")
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    args = sweep_args(work, tmp_path / "unused")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           json.dumps(args), str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=ENV, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {f"rank {r}": json.loads((tmp_path / f"report-rank{r}.json").read_text()) for r in (0, 1)}
    for r in reports.values():
        assert (r["ran"], r["skipped"], r["model_loads"]) == (0, 3, 0)
    assert not (tmp_path / "rank1").exists()


# ------------------------------------------------------------------------------ make


def test_make_eval_owt_shards_starts_independent_processes_then_collects():
    lines = subprocess.run(["make", "-n", "eval-owt", "NGPU=8", "SHARDS=4"], cwd=REPO, capture_output=True, text=True,
                           check=True, timeout=HANG_S).stdout.splitlines()
    (launch,) = [line for line in lines if " sweep " in line]
    jobs = launch.split(" & ")
    assert [f"--shard {i}/4 --keep-going" in job for i, job in enumerate(jobs[:4])] == [True] * 4
    assert "torchrun" not in launch and launch.count("CUDA_VISIBLE_DEVICES=") == 4 and "wait" in jobs[-1]
    for job in jobs[:4]:
        assert set(GRIDS["owt"].models) <= set(job.split("--models", 1)[1].split("--device")[0].split())
    collect = next(i for i, line in enumerate(lines) if "leaderboard collect" in line)
    assert collect > lines.index(launch)
    dry = subprocess.run(["make", "-n", "eval-owt", "NGPU=8", "SHARDS=3", "DRY_RUN=1"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=HANG_S).stdout
    assert ["--dry-run" in part and f"--shard {i}/3" in part for i, part in enumerate(dry.split(" && ")[:3])] == [True] * 3
