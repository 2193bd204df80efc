"""The rates file (harness/costs/rates.py) and the full-scale prices made from it (`blockgen sweep GRID --dry-run`).

- A rates file round-trips through JSON; a bad one is refused with the file and the field named.
- The stored H100 file holds the figures docs/results.md measured (seconds / model calls), nothing else.
- Lookups: the asked precision, else its dtype with TF32 the other way (said); batches interpolated
  between measured ones; EIPC and AR sampling at ancestral's and greedy's calls; no rate for block sizes
  or passes that were not measured.
- Which file prices a sweep: --rates, else a paper-size runs/gpu-check/rates.json, else the stored one;
  a micro-size file cannot price a full-scale grid; a sharded sweep never picks up the user's file.
- The dry run of a full-scale grid prints the measured-rate total and the rates file; another rates file
  changes the measured part in proportion and leaves the FLOP bound alone.
- The sweep's progress bar is weighted by the priced costs (`priced`).
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from blockgen.harness.checkpoints import checkpoint
from blockgen.harness import cli
from blockgen.harness.costs import data_file, rates
from blockgen.harness.evaluation import evaluations, pricing, sweep
from blockgen.harness.costs.rates import PassRate, RatesError, TrainRate, read_rates, write_rates

TOTAL = re.compile(r"total: .*, ([0-9.]+) h \(([0-9.]+) GPU-h at measured rates \((.*)\) \+ ([0-9.]+) H200-h FLOP bound "
                   r"where no rate was measured; FLOP bound of all: ([0-9.]+) H200-h")


TRAIN_ROW = {"precision": "bfloat16+tf32", "prior": "masked", "block_sizes": [1, 16], "micro_batch": 32, "seq_len": 1024,
             "tokens_per_s": 164000.0, "peak_memory_gb": 51.0}


@pytest.fixture(autouse=True)
def no_user_rates(monkeypatch, tmp_path):
    """Whatever `make gpu-check` left in this checkout's runs/gpu-check does not price these tests' sweeps."""
    monkeypatch.chdir(tmp_path)


def stored() -> rates.Rates:
    return read_rates(rates.STORED_RATES)


def scaled(factor: float, **changes) -> rates.Rates:
    """The stored rates with every measured second times `factor`."""
    r = stored()
    return replace(r, sampler_calls=tuple(replace(c, seconds=c.seconds * factor) for c in r.sampler_calls),
                   likelihood_passes=tuple(replace(p, seconds=p.seconds * factor) for p in r.likelihood_passes), **changes)


def dry_run(*args: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["sweep", *args, "--dry-run"]) == 0
    return out.getvalue()


def test_round_trip_and_the_stored_file_holds_the_measured_figures(tmp_path):
    r = stored()
    assert read_rates(write_rates(r, tmp_path / "copy.json")) == r
    assert (tmp_path / "copy.json").read_text() == data_file.to_json(r) == rates.STORED_RATES.read_text()
    assert (r.version, r.device, r.size) == (rates.RATES_VERSION, "NVIDIA H100 80GB HBM3", "paper")
    assert "docs/results.md" in r.provenance.source and r.provenance.date == "2026-11-26"
    # docs/results.md's generation table: seconds per generate() run at batch 1 and 64 / its model calls
    table = {("ar_greedy", 1): 2.98 / 256, ("ar_greedy", 64): 3.14 / 256, ("arpc", 1): 1.79 / 128,
             ("arpc", 64): 2.40 / 128, ("ancestral", 1): 3.60 / 256, ("ancestral", 64): 3.76 / 256}
    assert {(c.sampler, c.batch): c.seconds for c in r.sampler_calls} == pytest.approx(table, rel=1e-5)
    assert {c.precision for c in r.sampler_calls} == {"float32+tf32"}  # the stage ran with TF32 on then
    assert r.likelihood_passes == ()  # not measured on the H100: priced by the FLOP bound
    # docs/results.md's training table: the masked prior at block size 16 alone (not a mixture), bf16 with TF32 on
    assert {(t.prior, t.block_sizes, t.micro_batch, t.seq_len, t.precision): (t.tokens_per_s, t.peak_memory_gb) for t in r.training} == {
        ("masked", (16,), 8, 1024, "bfloat16+tf32"): (135_900, 15.0), ("masked", (16,), 32, 1024, "bfloat16+tf32"): (164_000, 51.0)}
    assert rates.training_tokens_per_s(r, "masked", 1024, 32) == 164_000 and rates.training_tokens_per_s(r, "uniform", 1024) is None


@pytest.mark.parametrize("change, field, problem", [
    (lambda d: d.update(version=3), "version", "expected one of [1, 2], found 3"),
    (lambda d: d.pop("device"), "device", "missing"),
    (lambda d: d["sampler_calls"][1].update(seconds="fast"), r"sampler_calls\[1\]\.seconds", "expected float, found 'fast'"),
    (lambda d: d["sampler_calls"][2].update(seconds=-0.01), r"sampler_calls\[2\]\.seconds", "a positive number"),
    (lambda d: d["sampler_calls"][0].update(secnds=0.01), r"sampler_calls\[0\]\.secnds", "unknown field"),
    (lambda d: d["sampler_calls"][0].update(precision="fp16"), r"sampler_calls\[0\]\.precision", "one of"),
    (lambda d: d["sampler_calls"][0].update(sampler="beam"), r"sampler_calls\[0\]\.sampler", "one of"),
    (lambda d: d["sampler_calls"][0].update(batch=2.5), r"sampler_calls\[0\]\.batch", "expected int"),
    (lambda d: d.update(likelihood_passes=[{"precision": "bfloat16", "algo": "blockgen", "prior": "absorb",
                                            "batch": 32, "seq_len": 1024, "seconds": 0.1}]),
     r"likelihood_passes\[0\]\.prior", "masked or uniform"),
    (lambda d: d["provenance"].pop("commit"), r"provenance\.commit", "missing"),
    (lambda d: d.update(size="huge"), "size", "one of"),
    (lambda d: d.update(training=[{**TRAIN_ROW, "tokens_per_s": 0}]), r"training\[0\]\.tokens_per_s", "a positive number"),
    (lambda d: d.update(training=[{**TRAIN_ROW, "block_sizes": []}]), r"training\[0\]\.block_sizes", "one or more integers"),
    (lambda d: d.update(training=[{**TRAIN_ROW, "peak_memory_gb": "lots"}]), r"training\[0\]\.peak_memory_gb", "expected float"),
    (lambda d: d.update(training=[{**TRAIN_ROW, "prior": "absorb"}]), r"training\[0\]\.prior", "masked or uniform"),
])
def test_a_bad_rates_file_names_the_file_and_the_field(tmp_path, change, field, problem):
    data = json.loads(rates.STORED_RATES.read_text())
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RatesError, match=rf"rates file {re.escape(str(path))}: {field}: .*{re.escape(problem)}"):
        read_rates(path)


def test_a_version_1_file_reads_as_version_2_without_training(tmp_path):
    """Files written before training rates (version 1, no `training` list) still load: none measured."""
    data = json.loads(rates.STORED_RATES.read_text())
    data.pop("training")
    data["version"] = 1
    (tmp_path / "v1.json").write_text(json.dumps(data))
    old = read_rates(tmp_path / "v1.json")
    assert old == replace(stored(), training=()) and old.version == rates.RATES_VERSION == 2 and old.training == ()


def test_training_rates_round_trip_and_the_lookup(tmp_path):
    rows = (TrainRate("bfloat16+tf32", "masked", (1, 16), 8, 1024, 136_000.0, 15.0),
            TrainRate("bfloat16+tf32", "masked", (1, 16), 32, 1024, 164_000.0, 51.0),
            TrainRate("bfloat16+tf32", "uniform", (1, 16), 32, 1024, 150_000.0, None),
            TrainRate("bfloat16+tf32", "masked", (1, 16), 64, 512, 170_000.0, 50.0))
    r = read_rates(write_rates(replace(stored(), training=rows), tmp_path / "train.json"))
    assert r.training == rows and "training in bfloat16+tf32" in r.describe()
    assert rates.training_tokens_per_s(r, "masked", 1024, 8) == 136_000.0  # the asked micro-batch
    assert rates.training_tokens_per_s(r, "masked", 1024) == 164_000.0  # none asked: the largest measured
    assert rates.training_tokens_per_s(r, "masked", 1024, 16) == 164_000.0  # not measured: the largest measured
    assert rates.training_tokens_per_s(r, "uniform", 1024, 8) == 150_000.0
    assert rates.training_tokens_per_s(r, "masked", 512, 64) == 170_000.0
    assert rates.training_tokens_per_s(r, "uniform", 512) is None  # no row for that prior and length
    assert rates.training_tokens_per_s(stored(), "uniform", 1024) is None  # the stored H100 file: masked only


def test_not_json_or_missing_is_one_line(tmp_path):
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(RatesError, match=r"x\.json: not JSON"):
        read_rates(tmp_path / "x.json")
    with pytest.raises(RatesError, match=r"nothing\.json: cannot read it"):
        read_rates(tmp_path / "nothing.json")


def test_lookups_interpolate_batches_and_say_what_stood_in():
    r = replace(stored(), likelihood_passes=(PassRate("bfloat16", "blockgen", "masked", 8, 1024, 0.02),
                                             PassRate("bfloat16", "blockgen", "masked", 32, 1024, 0.07)))
    one, sixty_four = (next(c.seconds for c in r.sampler_calls if c.sampler == "arpc" and c.batch == b) for b in (1, 64))
    seconds, how = r.call_seconds("arpc", 16, 32, "float32")
    assert seconds == pytest.approx(one + (sixty_four - one) * 31 / 63)
    assert "interpolated between 1 and 64" in how and "measured in float32+tf32 for float32" in how
    assert r.call_seconds("arpc", 16, 64, "float32+tf32") == (sixty_four, "arpc calls of 16-token blocks, batch 64")
    assert r.call_seconds("arpc", 16, 128, "float32+tf32")[0] == pytest.approx(2 * sixty_four)  # beyond: per row
    eipc, how = r.call_seconds("eipc", 16, 64, "float32+tf32")
    assert eipc == r.call_seconds("ancestral", 16, 64, "float32+tf32")[0] and "(for eipc)" in how
    assert r.call_seconds("ancestral", 1024, 32, "float32") == (None, "no measured ancestral calls of 1024-token blocks in float32")
    assert r.call_seconds("arpc", 16, 32, "bfloat16")[0] is None  # another dtype never stands in
    assert r.pass_seconds("blockgen", "masked", 1024, 32, "bfloat16")[0] == 0.07
    assert r.pass_seconds("blockgen", "masked", 1024, 16, "bfloat16")[0] == pytest.approx(0.02 + 0.05 * 8 / 24)
    assert r.pass_seconds("blockgen", "uniform", 1024, 32, "bfloat16")[0] is None
    assert r.pass_seconds("blockgen", "masked", 512, 32, "bfloat16")[0] is None
    assert rates.precision_label("auto") == rates.precision_label(None) == "float32"
    assert rates.precision_label("bfloat16", tf32=True) == "bfloat16+tf32"


def test_which_file_prices_a_sweep(tmp_path):
    user = rates.gpu_check_rates(tmp_path / "runs")  # where `make gpu-check RUNS=...` writes it
    assert user == tmp_path / "runs" / "gpu-check" / "rates.json"
    source = rates.rate_source(user=user)
    assert source.path == rates.STORED_RATES and source.note == ""  # none written yet
    micro = write_rates(replace(stored(), size="micro", device="x86_64"), tmp_path / "micro.json")
    with pytest.raises(RatesError, match=rf"rates file {re.escape(str(micro))}: size: 'micro'.*make gpu-check"):
        rates.rate_source(str(micro))
    write_rates(replace(stored(), size="micro"), user)  # gpu-check on a CPU
    source = rates.rate_source(user=user)
    assert source.path == rates.STORED_RATES and "passed over: measured at micro size" in source.note
    write_rates(scaled(2.0, device="NVIDIA H200"), user)  # a GPU run's file
    assert rates.rate_source(user=user).path == user
    owt = sweep.SweepConfig("owt", runs=str(tmp_path / "runs"))
    assert owt.rate_source(owt.resolved_grid()).path == user
    sharded = replace(owt, shard=pricing.Shard(0, 2))  # every job of a sharded sweep prices alike
    source = sharded.rate_source(sharded.resolved_grid())
    assert source.path == rates.STORED_RATES and "sharded" in source.note
    with pytest.raises(ValueError, match="--rates prices full-scale grids; grid owt-embedded"):
        sweep.SweepConfig("owt-embedded", rates=str(user)).rate_source(sweep.SweepConfig("owt-embedded").resolved_grid())


def test_dry_run_prints_the_measured_total_and_its_source_and_follows_the_rates(tmp_path):
    text = dry_run("owt")
    total, measured, device, derived, bound = TOTAL.search(text).groups()
    assert device == "NVIDIA H100 80GB HBM3" and f"{rates.STORED_RATES.name}: NVIDIA H100 80GB HBM3" in text
    assert float(total) > 3 * float(bound)  # the bill: measured calls, not the FLOP count
    double = write_rates(scaled(2.0, device="Twice as slow"), tmp_path / "slow.json")
    text2 = dry_run("owt", "--rates", str(double))
    total2, measured2, device2, derived2, bound2 = TOTAL.search(text2).groups()
    assert re.search(r"# rates: \S*slow\.json: Twice as slow, paper size", text2) and device2 == "Twice as slow"
    assert float(measured2) == pytest.approx(2 * float(measured), abs=0.002)  # in proportion to the rates
    assert (derived2, bound2) == (derived, bound)  # what no rate prices, and the bound, stay
    assert float(total2) == pytest.approx(float(total) + float(measured), abs=0.003)


def test_measured_likelihood_passes_replace_the_bound(tmp_path):
    with_passes = replace(stored(), likelihood_passes=tuple(PassRate("bfloat16", "blockgen", p, 32, 1024, 0.05)
                                                            for p in ("masked", "uniform")))
    path = write_rates(with_passes, tmp_path / "passes.json")
    line = next(x for x in dry_run("owt", "--rates", str(path)).splitlines()
                if x.startswith("owt-masked-mix-flat  owt_ppl  likelihood"))
    # 110,000 sequences in batches of 32, 33 passes each, at 0.05 s a pass
    assert "113454 batched calls x 50.00 ms (blockgen masked likelihood passes at L = 1024, batch 32)" in line
    assert line.split("  ")[4] == f"{113454 * 0.05 / 3600:.3f} h"


def test_progress_bar_is_weighted_by_the_priced_costs(tmp_path, monkeypatch):
    bars = []

    class Bar:  # records what the sweep tells its bar
        def __init__(self, total):
            self.total, self.updates = total, []
            bars.append(self)

        def update(self, n):
            self.updates.append(n)

        def refresh(self):
            pass

        def set_postfix_str(self, *args, **kwargs):
            pass

        def close(self):
            pass

    class Recorded(sweep._Progress):
        def __init__(self, todo, costs, enabled=True):
            super().__init__(todo, costs, enabled=False)
            self.bar = Bar(self.bar.total)

    monkeypatch.setattr(sweep, "_Progress", Recorded)
    monkeypatch.setattr(sweep, "_require_checkpoints", lambda g, todo: None)
    monkeypatch.setattr(sweep, "_load_model", lambda s, g, device, seed=None: (object(), None))
    monkeypatch.setattr(sweep, "_evaluate", lambda s, *args: None)
    monkeypatch.setattr(checkpoint, "checkpoint_hash", lambda path: "sha")
    # the first setting (owt-ar's likelihood) was done before: it leaves the bar's total
    monkeypatch.setattr(sweep, "_done", lambda folder, mark: folder == tmp_path / "out" / "owt-ar" / "likelihood-bfloat16")
    config = sweep.SweepConfig("owt", runs=str(tmp_path / "runs"), out_dir=str(tmp_path / "out"), models=("ar", "masked-mix"))
    report = sweep.run_sweep(config)
    g = config.resolved_grid()
    todo = evaluations.evaluations(g, config.runs)
    costs = pricing.priced(g, todo, config.metadata, rates.read_rates(rates.STORED_RATES))
    assert (report.skipped, report.ran) == (1, len(todo) - 1) and todo[0].label == "likelihood-bfloat16"
    (bar,) = bars
    assert bar.updates == costs[1:]  # each setting as the dry run prices it, in the order they ran
    assert bar.total == pytest.approx(sum(costs[1:]))
    assert len(set(costs)) > 2  # weights, not a count of settings
