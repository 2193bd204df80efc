"""Evaluation precision and cost: the adapter's `dtype` / `tf32` model arguments (harness/runtime/precision.py)
and `blockgen sweep --dry-run`'s cost lines (harness/costs/eval_cost.py, harness/evaluation/pricing.py).

- `dtype` takes lm-eval's names and refuses others naming the choices; the default (float32) gives
  bit for bit what the model gives with no precision context at all (the code before the option),
  keeps its fingerprint, and `auto` is the same; bfloat16 (autocast) moves a micro model's bounds by
  little but does move them, while the logits, and so the bounds, stay float32/float64.
- TF32 flags are set only inside the adapter's model calls and restored after.
- The dry run prices each setting (CPU-seconds from the measured rates offline; at full scale hours at
  the rates file's measured rates, the derived FLOP bound where it has none and beside each line),
  names its assumptions and its rates file, and its per-model subtotals and total are the lines' sums;
  the counted work follows the samplers' calls and the bound's passes. (The rates file itself:
  tests/test_rates.py.)
- The measured CPU rates and the H200 reference steps are data files (harness/costs/measured_rates/),
  read when first priced; a missing or malformed one is a one-line error naming it.
- The `owt` grid scores the whole held-out split (the paper's validation set): no limit.
"""

from __future__ import annotations

import io
import json
import math
import re
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blockgen.harness import cli
from blockgen.harness.costs import eval_cost
from blockgen.harness.costs.data_file import RatesError, read_dataclass
from blockgen.harness.evaluation import evaluations, pricing
from blockgen.harness.evaluation.grids import GRIDS
from blockgen.harness.runtime.precision import compute_precision

SPECIAL = {"bos": 0, "eos": 1, "pad": 2, "sep": [3]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A micro mixture {1, 8} with random weights and a small BPE (numbers, not quality)."""
    from blockgen.harness.checkpoints.checkpoint import save_checkpoint
    from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
    from blockgen.models.backbone import SIZES
    from blockgen.models.model import BlockGen, BlockGenConfig
    from blockgen.tasks.blockgen_toy import training_text

    tok = train_bpe(training_text(300), vocab_size=300)
    config = BlockGenConfig(vocab_size=len(tok), seq_len=64, prior="masked", block_sizes=(1, 8), block_weights=(0.2, 0.8),
                            special_tokens=special_tokens(tok).to_dict(), shape=SIZES["micro"])
    torch.manual_seed(0)
    model = BlockGen(config).eval()
    with torch.no_grad():  # non-trivial outputs (the final layer is zero-initialised)
        for p in model.parameters():
            p.normal_(0, 0.05)
    return save_checkpoint(tmp_path_factory.mktemp("precision") / "ckpt", model, tok)


def _lm(path: Path, **kwargs):
    from lm_eval.api.registry import get_model

    import blockgen.harness.evaluation.lm_eval_model.model  # noqa: F401  registers the model type

    return get_model("blockgen")(pretrained=str(path), device="cpu", batch_size=4, seed=3, **kwargs)


def _requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


LL = [("the cat sat", " on the mat"), ("one plus two is", " three"), ("", "a whole sentence to score here")]
GEN = [("the cat", {"until": [], "max_gen_toks": 16}), ("one plus", {"until": [], "max_gen_toks": 16})]


def test_dtype_and_tf32_arguments_name_their_choices(ckpt):
    from lm_eval.api.registry import get_model

    import blockgen.harness.evaluation.lm_eval_model.model  # noqa: F401  registers the model type
    from blockgen.harness.evaluation.lm_eval_model.arguments import BlockGenLMArgs

    assert BlockGenLMArgs.parse({"pretrained": "x"}).dtype == "float32"
    assert BlockGenLMArgs.parse({"pretrained": "x", "dtype": torch.bfloat16}).dtype == "bfloat16"
    cls = get_model("blockgen")
    for extra, message in {"dtype=float16": "dtype='float16'; choose one of ['auto', 'bfloat16', 'float32']",
                           "dtype=bf16": "choose one of ['auto', 'bfloat16', 'float32']",
                           "tf32=yes": "tf32='yes'; must be true or false"}.items():
        with pytest.raises(ValueError) as err:  # lm-eval's own argument parsing, as on the command line
            cls.create_from_arg_string(f"pretrained={ckpt},{extra}", {"device": "cpu"})
        assert message in str(err.value), (extra, str(err.value))
    lm = cls.create_from_arg_string(f"pretrained={ckpt},dtype=bfloat16,tf32=True", {"device": "cpu"})
    assert (lm.args.dtype, lm.args.tf32) == ("bfloat16", True)
    assert lm.get_model_info()["blockgen"]["dtype"] == "bfloat16"


def test_float32_default_is_the_code_without_the_option_bit_for_bit(ckpt):
    from blockgen.harness.evaluation.lm_eval_model.scoring import Window, derive_seed, score_windows
    from blockgen.models.sampler_config import SamplerConfig
    from blockgen.models.sampling import generate

    default, explicit, auto = _lm(ckpt), _lm(ckpt, dtype="float32"), _lm(ckpt, dtype="auto")
    ll = default.loglikelihood(_requests("loglikelihood", LL))
    assert ll == explicit.loglikelihood(_requests("loglikelihood", LL)) == auto.loglikelihood(_requests("loglikelihood", LL))
    gen = default.generate_until(_requests("generate_until", GEN))
    assert gen == explicit.generate_until(_requests("generate_until", GEN)) == auto.generate_until(_requests("generate_until", GEN))
    # the model called with no precision context at all, as before the option existed
    windows = [Window(tuple(range(5, 40)), 3), Window(tuple(range(7, 30)), 1)]
    bare = score_windows(default.model, windows, [1, 2], 2, default.special.pad)
    with compute_precision("cpu", "float32"):
        assert score_windows(default.model, windows, [1, 2], 2, default.special.pad) == bare
    prompts = [[0, 5, 6, 7], [0, 9]]
    sampler = SamplerConfig("arpc", steps=4, max_new_tokens=16)
    bare_gen = generate(default.model, prompts, sampler, 1, 2, seeds=[4, 5]).tokens
    with compute_precision("cpu", "float32"):
        assert generate(default.model, prompts, sampler, 1, 2, seeds=[4, 5]).tokens == bare_gen
    # the fingerprint (--use_cache's table) of a float32 run is the one it had before the option
    a = default.args
    assert default.fingerprint == derive_seed(default.checkpoint_hash, a.k_mc, a.seed, a.add_bos,
                                              default.sampler.as_dict()).to_bytes(8, "little").hex()
    assert _lm(ckpt, dtype="bfloat16").fingerprint != default.fingerprint


def test_bfloat16_is_close_to_float32_and_keeps_the_bounds_in_float(ckpt):
    fp32, bf16 = _lm(ckpt), _lm(ckpt, dtype="bfloat16")
    a = [lp for lp, _ in fp32.loglikelihood(_requests("loglikelihood", LL))]
    b = [lp for lp, _ in bf16.loglikelihood(_requests("loglikelihood", LL))]
    assert a != b  # autocast really ran in bf16
    for x, y in zip(a, b):
        assert abs(x - y) <= 0.02 * abs(x), (x, y)
    rolling = _requests("loglikelihood_rolling", [("a longer text that the rolling windows score token by token",)])
    x, y = fp32.loglikelihood_rolling(rolling)[0], bf16.loglikelihood_rolling(rolling)[0]
    assert abs(x - y) <= 0.02 * abs(x)
    assert len(bf16.generate_until(_requests("generate_until", GEN))) == len(GEN)
    model = bf16.model  # under autocast the matmuls are bf16, the logits (and all that follows) float32
    x0 = torch.randint(4, 100, (2, 64))
    with compute_precision("cpu", "bfloat16"):
        logits = model.dit.forward_train(x0, x0.clone(), 8)
    assert logits.dtype == torch.float32


BF16_ATTENTION = """
import torch, torch.nn.functional as F
from blockgen.harness.runtime.precision import compute_precision, cpu_kernels_have_avx512
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 96, 16) for _ in range(3))
mask = torch.ones(96, 96, dtype=torch.bool).tril()
with compute_precision("cpu", "bfloat16"):
    y = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask)
exact = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
print(torch.backends.cpu.get_cpu_capability(), cpu_kernels_have_avx512(), y.dtype, float((y.float() - exact).abs().max()))
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_bfloat16_attention_runs_where_aten_kernels_are_not_avx512(capability):
    """torch 2.13's CPU flash attention in bf16 raises "pack_vnni2 is only supported when avx512 is supported" on
    AVX-512 hardware when ATen's kernels are not the AVX-512 ones; there bf16 attends with the math kernel."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", BF16_ATTENTION], env=env, capture_output=True, text=True, check=True)
    name, avx512, dtype, error = out.stdout.split()
    assert name in {capability.upper(), "DEFAULT"}  # a CPU without AVX2 runs the scalar kernels
    assert (avx512, dtype) == ("False", "torch.bfloat16")
    assert float(error) < 0.05  # bf16 rounding of attention outputs of size ~1


def test_tf32_is_set_only_inside_the_model_calls():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with compute_precision(torch.device("cuda", 0), "float32", tf32=True):
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
        with compute_precision(torch.device("cuda", 0), "float32", tf32=False):  # opt-in: untouched otherwise
            assert not torch.backends.cuda.matmul.allow_tf32
        with compute_precision("cpu", "float32", tf32=True):  # no CUDA: nothing to set
            assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _dry_run(name: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["sweep", name, "--dry-run"]) == 0
    return out.getvalue()


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith(("#", "total:"))]


def _sum(lines: list[str], unit: str) -> float:
    return sum(float(m.group(1)) for line in lines if (m := re.search(rf"  ([0-9.]+) {unit}  ", line + "  ")))


@pytest.mark.parametrize("name", ["gsm8k-embedded", "owt-embedded", "demo"])
def test_offline_dry_run_prices_every_setting_from_measured_rates(name):
    text = _dry_run(name)
    assert "MEASURED by bench/bench_eval_cost.py" in text and eval_cost.cpu_rates().measured in text
    g = GRIDS[name]
    lines = [line for line in _lines(text) if "owt_ppl" not in line or g.limit is not None]
    assert lines and all(" CPU-s  (" in line for line in lines)  # every setting priced
    total = float(re.search(r"total: .*, ([0-9.]+) CPU-s", text).group(1))
    assert total == pytest.approx(_sum(_lines(text), "CPU-s"), abs=0.05 * len(lines) + 0.1)
    subtotals = [float(x) for x in re.findall(r"# model .*: \d+ settings, ([0-9.]+) CPU-s", text)]
    assert len(subtotals) == len(g.models) and sum(subtotals) == pytest.approx(total, abs=0.05 * len(g.models) + 0.1)


def test_offline_cost_is_the_counted_calls_times_the_measured_rate():
    from blockgen.models.sampler_config import SamplerConfig, calls_per_block

    g = GRIDS["gsm8k-embedded"]
    todo = {(s.run, s.label): s for s in evaluations.evaluations(g)}
    price = pricing.estimate(g, todo["tinygsm-embedded-masked-mix", "arpc-6-3-0-T0.1"], "masked-mix")
    seconds, what = price.seconds, price.what
    per_block = calls_per_block(SamplerConfig("arpc", steps=6, ge=3, warmup=0, block_size=16), 16)
    # 16 problems in full batches (one batch per setting, per-row budgets inside it), a budget of
    # 128 - 128 // 4 tokens in blocks of 16
    calls = math.ceil(16 / g.batch_size) * per_block * math.ceil(96 / 16)
    rate, _ = eval_cost.cpu_rate("tinygsm-embedded-masked-mix", g.batch_size)
    # besides the model calls: each problem's program in the sandbox, and the setting's fixed overhead
    measured = eval_cost.cpu_rates()
    extra = 16 * measured.sandbox_program_s + measured.setting_overhead_s["gsm8k_code_embedded"]
    assert f"= {calls} batched calls" in what and seconds == pytest.approx(calls * rate.call_s + extra)
    demo = GRIDS["demo"]  # a max_gen_toks cap: full batches of the capped budget
    what = pricing.estimate(demo, next(s for s in evaluations.evaluations(demo) if s.label == "ancestral-4-1-0-T0.1"
                                     and s.run == "gsm-masked-mix"), "gsm-masked-mix").what
    assert f"500 rows / {demo.batch_size} per call x {4 * 80 // 16} sampler calls" in what
    assert eval_cost.Work("likelihood", 16, 8, eval_cost.likelihood_passes((1, 16), 2)).batched_calls == 2 * 3
    assert eval_cost.likelihood_passes((1, 2, 4, 8, 16), 8) == 33  # mix-flat at K_MC 8
    scaled, note = eval_cost.cpu_rate("tinygsm-embedded-masked-mix", 2)
    single, _ = eval_cost.cpu_rate("tinygsm-embedded-masked-mix", 1)
    assert note == "rate scaled from batch 1" and scaled.call_s == pytest.approx(2 * single.call_s)
    assert eval_cost.cpu_rate("no-such-preset", 8) == (None, "no measured rate for no-such-preset")


def test_the_rates_files_hold_what_the_dry_run_prices_with():
    stored = json.loads(eval_cost.CPU_RATES_FILE.read_text())
    for preset, rows in stored["rates"].items():
        for row in rows:
            assert eval_cost.cpu_rate(preset, row["batch"]) == (eval_cost.CpuRate(**row), "")
    measured = eval_cost.cpu_rates()
    assert measured.measured == "2026-11-27, 2 torch thread(s) on 2 cores, load average 1.72 0.62 0.23"
    assert measured.setting_overhead_s == stored["setting_overhead_s"] and measured.sandbox_program_s == 0.0117
    reference = eval_cost.h200_reference()
    assert (reference.train_step_s, reference.step_batch, reference.step_len) == ({"two_stream": 0.094, "one_stream": 0.057}, 8, 1024)
    assert eval_cost.forward_seconds("one_stream", 1024) == pytest.approx(0.057 / 3 / 8)
    # the dry run's assumptions print the file's figures (their one home)
    assert "(0.094 s BlockGen over 2L, 0.057 s AR over L, batch 8 x 1,024)" in eval_cost.full_scale_assumptions()
    # given rates (a bench's fresh ones) price instead of the stored file's
    g = GRIDS["gsm8k-embedded"]
    s = next(s for s in evaluations.evaluations(g) if (s.run, s.label) == ("tinygsm-embedded-masked-mix", "arpc-6-3-0-T0.1"))
    calls_only = replace(measured, setting_overhead_s={}, sandbox_program_s=None)
    doubled = replace(calls_only, rates={p: tuple(replace(r, call_s=2 * r.call_s) for r in rows if r.call_s)
                                         for p, rows in measured.rates.items()})
    single = pricing.estimate(g, s, "masked-mix", cpu_rates=calls_only).seconds
    assert pricing.estimate(g, s, "masked-mix").seconds > single > 0
    assert pricing.estimate(g, s, "masked-mix", cpu_rates=doubled).seconds == pytest.approx(2 * single)

@pytest.mark.parametrize("text, problem", [(None, "cannot read it"), ("{", "not JSON"),
                                           ('{"source": "x", "train_step_s": {"one_stream": "fast"}, "step_batch": 8, "step_len": 1024}',
                                            "train_step_s.one_stream: expected float")])
def test_a_missing_or_malformed_rates_file_is_one_line_naming_it(tmp_path, monkeypatch, text, problem):
    path = tmp_path / "h200-reference.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(RatesError, match=rf"^rates file {re.escape(str(path))}: {problem}[^\n]*\Z"):
        read_dataclass(eval_cost.H200Reference, path)
    monkeypatch.setattr(eval_cost, "CPU_RATES_FILE", path)  # the cached loader names its file too
    eval_cost.cpu_rates.cache_clear()
    try:
        with pytest.raises(RatesError, match=re.escape(str(path))):
            eval_cost.cpu_rates()
    finally:
        eval_cost.cpu_rates.cache_clear()


def test_full_scale_dry_run_prices_at_measured_rates_beside_the_bound_and_scores_the_whole_held_out_split(monkeypatch, tmp_path):
    from blockgen.harness.costs import rates
    from blockgen.harness.costs.eval_cost import OWT_PPL_SEQUENCES

    monkeypatch.chdir(tmp_path)  # no runs/gpu-check/rates.json: the stored rates, whatever gpu-check wrote here
    g = GRIDS["owt"]
    assert g.limit is None  # the paper's Val. PPL: every held-out chunk (the authors validate on all of it)
    text = _dry_run("owt")
    assert "MEASURED on the rates file's device" in text and "H200-hours DERIVED" in text and "lower bound" in text
    assert re.search(rf"# rates: \S*{rates.STORED_RATES.name}: NVIDIA H100 80GB HBM3, paper size, 2026-11-26", text)
    flat = [line for line in _lines(text) if line.startswith("owt-masked-mix-flat  owt_ppl  likelihood")]
    assert len(flat) == 1 and f"{OWT_PPL_SEQUENCES} sequences x 33 passes" in flat[0]
    assert "FLOP bound" in flat[0]  # the stored file has no likelihood passes: priced by the bound
    total, measured, derived, bound = map(float, re.search(
        r"total: .*, ([0-9.]+) h \(([0-9.]+) GPU-h at measured rates .* \+ ([0-9.]+) H200-h FLOP bound where no rate "
        r"was measured; FLOP bound of all: ([0-9.]+) H200-h", text).groups())
    assert total == pytest.approx(_sum(_lines(text), "h"), rel=0.01) and total == pytest.approx(measured + derived, abs=0.002)
    bounds = sum(float(m.group(1)) for line in _lines(text) if (m := re.search(r"\(bound ([0-9.]+) H200-h\)", line)))
    assert bound == pytest.approx(bounds, rel=0.01)
    assert measured > 3 * bound  # the measured 12-19 ms per call, where the FLOP count sees microseconds


def test_sweep_precision_reaches_every_setting_and_its_own_folders():
    from blockgen.harness.evaluation.sweep import SweepConfig

    plain = evaluations.evaluations(SweepConfig("gsm8k-embedded").resolved_grid())
    assert all("dtype" not in dict(s.extra) for s in plain)  # float32: settings (and rerun keys) as before
    assert evaluations.evaluations(SweepConfig("gsm8k-embedded", dtype="auto").resolved_grid()) == plain
    g = SweepConfig("gsm8k-embedded", dtype="bfloat16", tf32=True).resolved_grid()
    bf16 = evaluations.evaluations(g)
    assert len(bf16) == len(plain)
    for a, b in zip(plain, bf16):
        assert b.label == a.label + "-bfloat16-tf32"  # never the float32 results' folder
        assert b.model_args(g.k_mc) == {**a.model_args(g.k_mc), "dtype": "bfloat16", "tf32": True}
    text = io.StringIO()
    with redirect_stdout(text):
        assert cli.main(["sweep", "gsm8k-embedded", "--dry-run", "--dtype", "bfloat16"]) == 0
    assert "# precision of this sweep: bfloat16" in text.getvalue() and "-T0.1-bfloat16  T=0.1" in text.getvalue()
    with pytest.raises(SystemExit):
        cli.main(["sweep", "gsm8k-embedded", "--dry-run", "--dtype", "float16"])


def test_full_scale_likelihoods_default_to_bf16_and_generation_stays_float32():
    """Full-scale grids score likelihoods under bf16 autocast unless --dtype says otherwise (measured:
    within 1e-4 relative); their sampling, and every offline/CI grid, stays float32."""
    from blockgen.harness.evaluation.sweep import SweepConfig

    full = evaluations.evaluations(SweepConfig("owt").resolved_grid())
    likelihood = [s for s in full if s.sampler is None]
    assert likelihood and all(dict(s.extra)["dtype"] == "bfloat16" and s.label == "likelihood-bfloat16" for s in likelihood)
    assert all("dtype" not in dict(s.extra) for s in full if s.sampler is not None)
    assert all("dtype" not in dict(s.extra) for s in evaluations.evaluations(SweepConfig("owt-embedded").resolved_grid()))
    for asked in ("float32", "auto"):  # an explicit float32 wins: the float32 code path, its own folders
        assert all("dtype" not in dict(s.extra) for s in evaluations.evaluations(SweepConfig("owt", dtype=asked).resolved_grid()))
    text = io.StringIO()
    with redirect_stdout(text):
        assert cli.main(["sweep", "owt", "--dry-run"]) == 0
    assert "# precision of this sweep: float32, likelihoods bfloat16 (the grid's default)" in text.getvalue()
