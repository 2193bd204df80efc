"""The training presets: one registry of named `TrainConfig`s, apart from the training loop.

- `PRESETS`: every preset by name (`blockgen train --preset NAME`, `blockgen presets` lists them as a
  table, `preset_table`; `--json`: every setting);
  `preset(name, **overrides)` returns one with some fields replaced.
- The demo's presets (`gsm-*`, `DEMO_PRESETS`) and where `blockgen demo` warm-starts them (`WARM_STARTS`).
- The paper's models as `VARIANTS` (a prior and a block-size mixture each) crossed with each
  benchmark's base config (`BENCHMARKS`): presets named `<benchmark>-<variant>`.
- The network sizes a preset picks by name (`TrainConfig.size`) are `blockgen.models.backbone.SIZES`,
  beside the `ModelShape` they instantiate.

A new preset is one entry in `PRESETS` (or a variant in `VARIANTS`, or a benchmark in `BENCHMARKS`);
the evaluation grids that run presets' checkpoints are in `harness/evaluation/grids.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from blockgen.harness.data.sources import DataConfig
from blockgen.harness.training.train_config import TrainConfig


def _mixture(sizes: tuple[int, ...], weights: tuple[float, ...]) -> dict:
    return {"block_sizes": sizes, "block_weights": weights}


# The embedded default's models (paper: gamma_1 = 0.05, gamma_16 = 0.95 for the ARPC mixtures), on the
# generator's default level ("easy"): the AR model first, then the diffusion models from its weights
# (`WARM_STARTS`). Cosine decay and the step counts fit the demo into 45 minutes on 2 cores
# (docs/demo.md); validation runs once, at the end, on 128 held-out problems.
# AdamW beta2 0.95: with 0.999 seed 2 sat hundreds of steps longer on the plateau before the model copies from its
# context. That plateau's length varied with the seed and the run (seed 4 left it at step 520-783) until the word
# problems' tokenizer split digits (`sources._splits_digits`: a copied number is then the same tokens in the question
# and the program) and gsm-ar's lr was halved: five seeds left it at steps 303-395 of 900 (docs/results.md).
_DEMO = dict(eval_every=10**9, save_every=100, lr=1.5e-3, lr_schedule="cosine", adam_beta2=0.95, data=DataConfig(n_val=128))
PRESETS: dict[str, TrainConfig] = {
    "gsm-ar": TrainConfig(**_mixture((1,), (1.0,)), batch_size=16, max_steps=900, **(_DEMO | {"lr": 7.5e-4})),
    "gsm-masked": TrainConfig(prior="masked", **_mixture((16,), (1.0,)), max_steps=250, **_DEMO),
    "gsm-uniform": TrainConfig(prior="uniform", **_mixture((16,), (1.0,)), max_steps=250, **_DEMO),
    "gsm-masked-mix": TrainConfig(prior="masked", **_mixture((1, 16), (0.05, 0.95)), max_steps=250, **_DEMO),
    "gsm-uniform-mix": TrainConfig(prior="uniform", **_mixture((1, 16), (0.05, 0.95)), max_steps=250, **_DEMO),
    # CI: seconds, not minutes.
    "ci": TrainConfig(
        prior="masked", **_mixture((1, 4), (0.5, 0.5)), size="micro", batch_size=16, max_steps=40, warmup_steps=5,
        eval_every=20, save_every=20, k_mc=2, data=DataConfig(n_train=2000, n_val=32, vocab_size=512),
    ),
}
PRESETS["ci-ar"] = replace(PRESETS["ci"], **_mixture((1,), (1.0,)))
# The synthetic language with exact probabilities (harness/data/language.py; `make demo`'s second part):
# a document is one example of seq_len = 64 (BOS, 61 one-token words, its EOS and the frame's), four blocks of 16.
# Every model starts from random weights.
_LANGUAGE = dict(size="micro", seq_len=64, batch_size=32, lr=3e-3, lr_schedule="cosine", adam_beta2=0.95, warmup_steps=20, max_steps=1000,
                 eval_every=10**9, save_every=200, data=DataConfig(source="language", n_train=20_000, n_val=128))
PRESETS |= {
    "lang-ar": TrainConfig(**_mixture((1,), (1.0,)), **_LANGUAGE),
    "lang-masked": TrainConfig(prior="masked", **_mixture((16,), (1.0,)), **_LANGUAGE),
    "lang-masked-mix": TrainConfig(prior="masked", **_mixture((1, 16), (0.05, 0.95)), **_LANGUAGE),
    "lang-uniform-mix": TrainConfig(prior="uniform", **_mixture((1, 16), (0.05, 0.95)), **_LANGUAGE),
}
LANGUAGE_PRESETS = ("lang-ar", "lang-masked-mix", "lang-uniform-mix", "lang-masked")
DEMO_PRESETS = ("gsm-ar", "gsm-masked-mix", "gsm-uniform-mix")
# Where a preset starts when `blockgen demo` trains both (`init_from`): the mixtures start from the AR
# model. From random weights they had not learned to copy numbers from the question after 1,000-1,800
# CPU steps (0-1 % solved); from the AR weights, 200 steps were enough (docs/results.md, "Why the demo's
# mixtures start from the AR model").
WARM_STARTS = {name: "gsm-ar" for name in ("gsm-masked", "gsm-uniform", "gsm-masked-mix", "gsm-uniform-mix")} | {"ci": "ci-ar"}


@dataclass(frozen=True)
class ModelRecipe:
    """One of the paper's models or baselines: a prior and a block-size mixture (no separate code).

    A block size of 0 stands for the benchmark's sequence length: one block over the whole sequence
    is full-sequence diffusion (MDLM-like for the masked prior, Duo-like for the uniform one).
    """

    prior: Literal["masked", "uniform"]
    block_sizes: tuple[int, ...]
    block_weights: tuple[float, ...]
    what: str
    architecture: Literal["blockgen", "ar"] = "blockgen"

    def config(self, base: TrainConfig, name: str) -> TrainConfig:
        sizes = tuple(b or base.seq_len for b in self.block_sizes)
        return replace(base, out_dir=f"runs/{name}", prior=self.prior, block_sizes=sizes, block_weights=self.block_weights,
                       architecture=self.architecture)


def _single(prior: str, block: int) -> ModelRecipe:
    loss = "cross-entropy" if prior == "masked" else "NELBO"
    return ModelRecipe(prior, (block,), (1.0,), f"single-block {prior} diffusion, L' = {block}, trained on the {loss}")


VARIANTS: dict[str, ModelRecipe] = {
    "ar": ModelRecipe("masked", (1,), (1.0,), "the paper's AR baseline: plain causal transformer over L tokens, exact NLL", "ar"),
    # BlockGen's own AR path ([x0 ; xt] over 2L at block size 1): the demo's gsm-ar, which mixtures warm-start from.
    "blockgen-b1": ModelRecipe("masked", (1,), (1.0,), "BlockGen at block size 1 ([x0 ; xt], 2L tokens): autoregressive, exact NLL"),
    **{f"{p}-{b}": _single(p, b) for p in ("masked", "uniform") for b in (4, 8, 16, 32)},
    "mdlm": ModelRecipe("masked", (0,), (1.0,), "full-sequence masked diffusion (MDLM-like): one block of L"),
    "duo": ModelRecipe("uniform", (0,), (1.0,), "full-sequence uniform diffusion (Duo-like): one block of L"),
    **{
        f"{p}-mix": ModelRecipe(p, (1, 16), (0.05, 0.95), f"BlockGen {p}, gamma_1 = 0.05, gamma_16 = 0.95 (table 1, figures 1-2)")
        for p in ("masked", "uniform")
    },
    **{
        f"{p}-mix32": ModelRecipe(p, (1, 32), (0.05, 0.95), f"BlockGen {p}, gamma_1 = 0.05, gamma_32 = 0.95 (block size 32 tables)")
        for p in ("masked", "uniform")
    },
    **{
        f"{p}-mix-flat": ModelRecipe(p, (1, 2, 4, 8, 16), (0.2,) * 5, f"BlockGen {p}, gamma_i = 0.2 over 1, 2, 4, 8, 16 (table 1)")
        for p in ("masked", "uniform")
    },
}

# The paper's training recipe (appendix: AdamW 3e-4, 2,500 warm-up steps, batch 512, clip 1, EMA
# 0.9999, dropout 0.1 in the "paper" size, bf16) and each benchmark's models. The "-embedded" twins
# run the same variants offline at small scale on CPU (offline text or word problems, micro model).
# micro_batch: the authors' sequences per GPU (OWT 16 GPUs x 32 x 1,024, TinyGSM 8 x 64 x 512 tokens),
# which fit an 80 GB GPU (32 x 1,024 peaked at 56.5 GB eager on an H200); with fewer GPUs the rest of
# the batch of 512 is gradient accumulation.
_PAPER = dict(size="paper", batch_size=512, lr=3e-4, warmup_steps=2500, ema_decay=0.9999, precision="bf16",
              compile=True, eval_every=10_000, save_every=5_000)
_OFFLINE = dict(size="micro", seq_len=128, batch_size=32, lr=3e-3, warmup_steps=20, max_steps=300, eval_every=300,
                save_every=100, k_mc=2)
_OWT_VARIANTS = ("ar", "blockgen-b1", "masked-4", "masked-8", "masked-16", "uniform-4", "uniform-8", "uniform-16", "mdlm", "duo",
                 "masked-mix", "uniform-mix", "masked-mix-flat", "uniform-mix-flat")
_TINYGSM_VARIANTS = ("ar", "blockgen-b1", "masked-16", "uniform-16", "masked-32", "uniform-32", "mdlm", "duo",
                     "masked-mix", "uniform-mix", "masked-mix32", "uniform-mix32")
BENCHMARKS: dict[str, tuple[TrainConfig, tuple[str, ...]]] = {
    # OWT, table 1: GPT-2 tokenizer, L = 1024, 1M steps (table 3's single-block runs stop at 250k).
    "owt": (TrainConfig(seq_len=1024, micro_batch=32, max_steps=1_000_000, data=DataConfig(source="owt", tokenizer="gpt2", n_val=1000), **_PAPER), _OWT_VARIANTS),
    # TinyGSM, figures 1-2 and tables 4-10: SmolLM-135M tokenizer, L = 512, 250k steps, loss on the padding
    # (the authors' train_on_pad=True; the embedded twin keeps the demo's setting, no loss on padding).
    "tinygsm": (
        TrainConfig(seq_len=512, micro_batch=64, max_steps=250_000, data=DataConfig(source="tinygsm", tokenizer="HuggingFaceTB/SmolLM-135M", n_val=1000, train_on_pad=True), **_PAPER),
        _TINYGSM_VARIANTS,
    ),
    "owt-embedded": (TrainConfig(data=DataConfig(source="text", vocab_size=1024, n_val=64), **_OFFLINE), _OWT_VARIANTS),
    "tinygsm-embedded": (TrainConfig(data=DataConfig(n_train=5000, n_val=64, vocab_size=512), **_OFFLINE), _TINYGSM_VARIANTS),
}
PRESETS.update(
    {f"{bench}-{v}": VARIANTS[v].config(base, f"{bench}-{v}") for bench, (base, variants) in BENCHMARKS.items() for v in variants}
)


def preset_table(presets: dict[str, TrainConfig] = PRESETS) -> str:
    """`blockgen presets`: one line per preset, the settings that tell presets apart (all: `--json`)."""
    header = ("name", "prior", "block sizes", "weights", "arch", "size", "L", "batch", "steps", "lr", "data")
    rows = [(name, "-" if c.architecture == "ar" else c.prior, " ".join(map(str, c.block_sizes)),
             " ".join(f"{w:g}" for w in c.block_weights), c.architecture, c.size, str(c.seq_len), str(c.batch_size),
             str(c.max_steps), f"{c.lr:g}", c.data.source) for name, c in presets.items()]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in (header, *rows)]
    return "\n".join(lines + ["(every setting of every preset: blockgen presets --json)"])


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)
