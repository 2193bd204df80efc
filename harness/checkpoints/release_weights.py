"""A release's config.json and state dict (the authors' names) as this project's `BlockGenConfig` and
state dict: every contradiction between config.json, the weights and the path's setting is an error
that names the file, what was expected and found, and the fix.

How the authors' network differs from this project's, and where each difference is handled:
- key names (`vocab_embed.embedding` without `.weight`, `attn_qkv`, `sigma_map`, `output_layer`, ...):
  renamed here (`map_weights`); `rotary_emb.inv_freq`, present or not, is checked and dropped;
- c = silu(MLP(e(sigma))): model option `cond_silu`;
- the AR baseline has no adaLN and is a plain causal transformer: `architecture="ar"`, `adaln=False`;
- MDLM / Duo run one bidirectional pass over the noisy sequence: `architecture="full_sequence"`;
  Duo embeds sigma = -log alpha_t: `time_conditioning=True`; BlockGen and MDLM embed sigma = 0,
  which is this project's constant conditioning (the embedding of t = 0);
- the uniform BlockGen models saw uniform draws at block size 1: `ar_placeholder="random"`;
- vocabulary: the rows follow the authors' rule (`release_vocab.release_rows`); [MASK] = V - 1 for
  absorb / mdlm / ar (this project's [MASK] = vocab_size is the same id); OWT's [MASK] 50257 is also
  the authors' [PAD], harmless here because padding is never attended to; the -1e6 mask logit and
  carry-over are this project's -inf (same probabilities);
- rotate-half rotary, bias-free LayerNorm, adaLN chunk order, GELU-tanh MLP: already identical.
"""

from __future__ import annotations

import re

import torch

from blockgen.harness.checkpoints.checkpoint import CONFIG, WEIGHTS
from blockgen.harness.checkpoints.release_paths import HUB_REPO, ReleaseError, ReleaseSetting, fetch_hint
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGenConfig


def vocab_rows(weights: dict[str, torch.Tensor], source: str) -> int:
    if "vocab_embed.embedding" not in weights:
        raise ReleaseError(f"{source}/{WEIGHTS}: no 'vocab_embed.embedding'; not a release of {HUB_REPO}; fix: {fetch_hint(None)}")
    return int(weights["vocab_embed.embedding"].shape[0])


def release_config(raw: dict, weights: dict[str, torch.Tensor], setting: ReleaseSetting, source: str,
                   special_tokens: dict | None = None) -> BlockGenConfig:
    """This project's config of a release: architecture from config.json, vocabulary from the weights,
    the rest from the (merged) setting; every contradiction is an error that says which."""
    missing = [k for k in ("type", "hidden_size", "cond_dim", "length", "n_blocks", "n_heads") if k not in raw]
    if missing:
        raise ReleaseError(f"{source}/{CONFIG}: missing {missing}; not a release config of {HUB_REPO}")
    kind, seq_len = raw["type"], int(raw["length"])
    rows = vocab_rows(weights, source)
    has_adaln = any(k.startswith("sigma_map.") for k in weights)
    algo = setting.algo
    if kind not in ("block-dit", "dit"):
        raise ReleaseError(f"{source}/{CONFIG}: type={kind!r}; expected 'block-dit' or 'dit'")
    _check_sizes(raw, weights, f"{source}/{CONFIG}")
    if (kind == "block-dit") != (algo == "blockgen"):
        raise ReleaseError(f"{source}: algo={algo} contradicts config.json type={kind!r} "
                           f"('block-dit' is BlockGen, 'dit' the AR / MDLM / Duo baselines)")
    if has_adaln == (algo == "ar"):
        raise ReleaseError(f"{source}: algo={algo} contradicts the weights: they {'have' if has_adaln else 'lack'} "
                           f"the adaLN / sigma_map tensors (only the AR baseline has none)")
    x0_causal = bool(raw.get("x0_causal", True))
    if algo == "blockgen" and setting.x0_causal is not None and setting.x0_causal != x0_causal:
        raise ReleaseError(f"{source}: x0_causal={setting.x0_causal} contradicts config.json (x0_causal={x0_causal})")
    if algo == "blockgen":
        sizes, weights_ = setting.block_sizes, setting.block_weights
        if sizes is None:
            raise ReleaseError(f"{source}: the path does not give the block sizes; pass block_sizes= (e.g. 1:16) and block_weights=")
        if weights_ is None:
            if len(sizes) != 1:
                raise ReleaseError(f"{source}: block_sizes={':'.join(map(str, sizes))} needs block_weights= (e.g. 0.05:0.95)")
            weights_ = (1.0,)
        if not x0_causal and 1 in sizes:
            raise ReleaseError(f"{source}: block size 1 contradicts the weights' block-causal clean stream "
                               f"(x0_causal=false in config.json: a single-block model)")
        architecture = "blockgen"
    elif algo == "ar":
        sizes, weights_, architecture = (1,), (1.0,), "ar"
    else:
        sizes, weights_, architecture = (seq_len,), (1.0,), "full_sequence"
    if algo != "blockgen" and setting.block_sizes is not None and tuple(setting.block_sizes) != sizes:
        raise ReleaseError(f"{source}: block_sizes={setting.block_sizes} contradicts algo={algo} (block sizes {sizes})")
    vocab = rows - 1 if setting.prior == "masked" else rows
    try:
        return BlockGenConfig(
            vocab_size=vocab, seq_len=seq_len, prior=setting.prior, block_sizes=tuple(sizes),
            block_weights=tuple(weights_),
            shape=ModelShape(n_layers=int(raw["n_blocks"]), d_model=int(raw["hidden_size"]), n_heads=int(raw["n_heads"]),
                             cond_dim=int(raw["cond_dim"]), dropout=float(raw.get("dropout", 0.1))),
            causal_clean=x0_causal if algo == "blockgen" else True,
            # flex or sdpa: only the kernel differs (the README of the release format); SDPA runs everywhere
            attention="sdpa", special_tokens=special_tokens or {}, architecture=architecture, adaln=algo != "ar",
            time_conditioning=algo == "duo", cond_silu=True,
            ar_placeholder="random" if algo == "blockgen" and setting.prior == "uniform" else "fixed",
        )
    except ValueError as err:
        raise ReleaseError(f"{source}/{CONFIG}: {err}; fix: fetch the release's {CONFIG} again") from None


def _check_sizes(raw: dict, weights: dict[str, torch.Tensor], where: str) -> None:
    """config.json's sizes against the tensors that carry them, so that a wrong field is named as such
    rather than surfacing as arithmetic on it (n_heads is visible only through rotary_emb.inv_freq)."""
    embed, inv_freq = weights["vocab_embed.embedding"], weights.get("rotary_emb.inv_freq")
    blocks = {k.split(".")[1] for k in weights if k.startswith("blocks.")}
    found = {"hidden_size": (embed.shape[1], f"vocab_embed.embedding {list(embed.shape)}"),
             "n_blocks": (len(blocks), f"blocks.0 ... blocks.{len(blocks) - 1}")}
    if "sigma_map.mlp.0.weight" in weights:
        found["cond_dim"] = (weights["sigma_map.mlp.0.weight"].shape[0],
                             f"sigma_map.mlp.0.weight {list(weights['sigma_map.mlp.0.weight'].shape)}")
    if inv_freq is not None and inv_freq.numel() and embed.shape[1] % (2 * inv_freq.numel()) == 0:
        found["n_heads"] = (embed.shape[1] // (2 * inv_freq.numel()),
                            f"rotary_emb.inv_freq {list(inv_freq.shape)}: head_dim {2 * inv_freq.numel()}")
    for key, (value, evidence) in found.items():
        if raw[key] != value:
            raise ReleaseError(f"{where}: {key} is {raw[key]!r}, but {WEIGHTS} has {value} ({evidence}); "
                               f"fix: set {key} to {value} (or fetch the release's {CONFIG} again)")


# The authors' key names and this project's, one template per tensor ({n}: a block).
_NAMES = [
    ("vocab_embed.embedding", "dit.embed.weight"),
    ("sigma_map.mlp.{i}.{p}", "dit.time.mlp.{i}.{p}"),
    ("blocks.{n}.attn_qkv.weight", "dit.blocks.{n}.attn.qkv.weight"),
    ("blocks.{n}.attn_out.weight", "dit.blocks.{n}.attn.out.weight"),
    ("blocks.{n}.adaLN_modulation.{p}", "dit.blocks.{n}.adaLN.{p}"),
    ("blocks.{n}.{norm}.weight", "dit.blocks.{n}.{norm}.weight"),
    ("blocks.{n}.mlp.{i}.{p}", "dit.blocks.{n}.mlp.{i}.{p}"),
    ("output_layer.norm_final.weight", "dit.final.norm.weight"),
    ("output_layer.linear.{p}", "dit.final.linear.{p}"),
    ("output_layer.adaLN_modulation.{p}", "dit.final.adaLN.{p}"),
]
_FIELDS = {"n": r"\d+", "i": "0|2", "p": "weight|bias", "norm": "norm1|norm2"}


def rename(key: str, to_project: bool = True) -> str | None:
    """An authors' key in this project's names (or back, `to_project=False`); None: no such tensor."""
    for authors, ours in _NAMES:
        source, target = (authors, ours) if to_project else (ours, authors)
        pieces = re.split(r"\{(\w+)\}", source)  # literal, field, literal, ...
        pattern = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{_FIELDS[p]})" for i, p in enumerate(pieces))
        match = re.fullmatch(pattern, key)
        if match:
            return target.format(**match.groupdict())
    return None


def map_weights(weights: dict[str, torch.Tensor], head_dim: int, source: str) -> dict[str, torch.Tensor]:
    """The authors' state dict in this project's names (float32). `rotary_emb.inv_freq` is optional in
    the release (strict loading off); when present it must be the base-10000 table both networks compute."""
    out = {}
    for key, value in weights.items():
        if key == "rotary_emb.inv_freq":
            want = 1.0 / 10_000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
            if value.shape != want.shape or not torch.allclose(value.float(), want, rtol=1e-6, atol=0):
                raise ReleaseError(f"{source}/{WEIGHTS}: rotary_emb.inv_freq is not the base-10000 table of head_dim "
                                   f"{head_dim}; fix: {fetch_hint(None)}")
            continue
        ours = rename(key)
        if ours is None:
            raise ReleaseError(f"{source}/{WEIGHTS}: unexpected tensor {key!r} {list(value.shape)}; not a release of {HUB_REPO}")
        out[ours] = value.float()
    return out
