"""The paper's released checkpoints (hub `jdeschena/blockgen`, one subfolder per model) as checkpoints of
this harness: the one module that maps a release onto this project's model and checkpoint layout.

A release subfolder holds `config.json` (the authors' model sub-config) and `model.safetensors` (the
EMA backbone weights, the authors' key names). Everything else comes from the subfolder's path:

    baselines/<dataset>/{ar,mdlm,duo}
    blockgen/single_block_size/<bs>/<dataset>/{absorb,uniform}          block sizes {bs}, block-causal clean stream
    blockgen/multi_block_size/<bs>/<dataset>/<w>/{absorb,uniform}       w = "a_b": gamma_1 = a, gamma_bs = b;
                                                                        w = "uniform": equal weights on 1, 2, 4, ..., bs

`<dataset>` names the tokenizer (owt: gpt2, tinygsm: SmolLM-135M); a `tokenizer=` override serves local
copies and datasets without one (the test fixtures). A release is converted once (`import_release`):
the architecture from config.json, the vocabulary from the embedding's rows, the weights renamed, the
tokenizer (with the authors' `[PAD]` rule) saved beside them; the result is an ordinary checkpoint
directory in a cache, whose config.json records the source (`training.source`). Every loader of
checkpoints therefore takes a release through `resolve`.

How the authors' network differs from this project's, and where each difference is handled:
- key names (`vocab_embed.embedding` without `.weight`, `attn_qkv`, `sigma_map`, `output_layer`, ...):
  renamed here (`map_weights`); `rotary_emb.inv_freq`, present or not, is checked and dropped;
- c = silu(MLP(e(sigma))): model option `cond_silu`;
- the AR baseline has no adaLN and is a plain causal transformer: `architecture="ar"`, `adaln=False`;
- MDLM / Duo run one bidirectional pass over the noisy sequence: `architecture="full_sequence"`;
  Duo embeds sigma = -log alpha_t: `time_conditioning=True`; BlockGen and MDLM embed sigma = 0,
  which is this project's constant conditioning (the embedding of t = 0);
- the uniform BlockGen models saw uniform draws at block size 1: `ar_placeholder="random"`;
- vocabulary: the rows follow the authors' rule (`release_rows`); [MASK] = V - 1 for absorb / mdlm / ar
  (this project's [MASK] = vocab_size is the same id); OWT's [MASK] 50257 is also the authors' [PAD],
  harmless here because padding is never attended to; the -1e6 mask logit and carry-over are this
  project's -inf (same probabilities);
- rotate-half rotary, bias-free LayerNorm, adaLN chunk order, GELU-tanh MLP: already identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from blockgen.harness.checkpoints.checkpoint import CONFIG, WEIGHTS, CheckpointError, save_checkpoint
from blockgen.harness.checkpoints.hub import OFFLINE_HINT, HubUnavailableError, file_id
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig

HUB_REPO = "jdeschena/blockgen"
HF_PREFIX = "hf:"
# Where `hf:jdeschena/blockgen/<subfolder>` is looked up before the hub: <dir>/<subfolder>.
LOCAL_DIR_ENV = "BLOCKGEN_RELEASE_DIR"
CACHE_ENV = "BLOCKGEN_RELEASE_CACHE"  # converted checkpoints (default ~/.cache/blockgen/released)

Algo = Literal["ar", "mdlm", "duo", "blockgen"]
ALGOS: tuple[str, ...] = ("ar", "mdlm", "duo", "blockgen")
PRIORS = {"absorb": "masked", "uniform": "uniform"}  # the path's last component -> this project's prior


@dataclass(frozen=True)
class DatasetSetting:
    tokenizer: str
    seq_len: int


DATASETS = {
    "owt": DatasetSetting("gpt2", 1024),
    "tinygsm": DatasetSetting("HuggingFaceTB/SmolLM-135M", 512),
}


class ReleaseError(CheckpointError):
    pass


# ------------------------------------------------------------------------------ the path


@dataclass(frozen=True)
class ReleaseSetting:
    """What a release's subfolder path says (None: the path does not say it)."""

    algo: Algo | None = None
    prior: Literal["masked", "uniform"] | None = None
    block_sizes: tuple[int, ...] | None = None
    block_weights: tuple[float, ...] | None = None
    x0_causal: bool | None = None
    dataset: str | None = None
    subfolder: str | None = None  # the path from `baselines/` or `blockgen/` on

    @property
    def tokenizer(self) -> str | None:
        return DATASETS[self.dataset].tokenizer if self.dataset in DATASETS else None


def _mixture(weights: str, block_size: int, where: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The authors' `algo.block_weights` over sizes 1, 2, 4, ..., bs as this project's (sizes, weights)."""
    sizes = [1]
    while sizes[-1] < block_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != block_size:
        raise ReleaseError(f"{where}: multi-block block size {block_size} is not a power of two")
    if weights == "uniform":  # the OWT scripts: "0.2 0.2 0.2 0.2 0.2", every size
        return tuple(sizes), tuple(1.0 / len(sizes) for _ in sizes)
    match = re.fullmatch(r"(\d*\.?\d+)_(\d*\.?\d+)", weights)
    if not match:
        raise ReleaseError(f"{where}: mixture weights {weights!r}; expected 'a_b' (gamma_1, gamma_{block_size}) or 'uniform'")
    a, b = float(match[1]), float(match[2])
    return (1, block_size), (a, b)


BASELINES = ("ar", "mdlm", "duo")
_MIDDLE = {"single_block_size": ("<dataset>",), "multi_block_size": ("<dataset>", "<weights a_b|uniform>")}


def _parse_tail(rest: list[str]) -> ReleaseSetting:
    """The setting of one `baselines/...` or `blockgen/...` tail; a ReleaseError names the component that
    breaks the layout (the hub's names are lower case and exact)."""
    where = "/".join(rest)
    if rest[0] == "baselines":
        if len(rest) == 3 and rest[2] in BASELINES:
            algo = rest[2]
            return ReleaseSetting(algo=algo, prior="uniform" if algo == "duo" else "masked", dataset=rest[1], subfolder=where)
        if len(rest) == 2 and rest[1] in BASELINES:
            raise ReleaseError(f"{where}: the dataset component is missing (baselines/<dataset>/{rest[1]})")
        if len(rest) == 3:
            raise ReleaseError(f"{where}: the model component {rest[2]!r} is not one of {list(BASELINES)}")
        raise ReleaseError(f"{where}: {len(rest)} components, expected baselines/<dataset>/<ar|mdlm|duo>")
    kind = rest[1] if len(rest) > 1 else ""
    if kind not in _MIDDLE:
        raise ReleaseError(f"{where}: the component {kind!r} after blockgen/ is not one of {list(_MIDDLE)}")
    middle = _MIDDLE[kind]
    template = "/".join(("blockgen", kind, "<block size>", *middle, "<absorb|uniform>"))
    if len(rest) < 4:
        raise ReleaseError(f"{where}: {len(rest)} components, expected {template}")
    if not rest[2].isdigit():
        raise ReleaseError(f"{where}: the block size component {rest[2]!r} is not a number ({template})")
    if rest[-1] not in PRIORS:
        raise ReleaseError(f"{where}: the prior component {rest[-1]!r} is not one of {list(PRIORS)} ({template})")
    given = rest[3:-1]
    if len(given) < len(middle):  # which one is missing: a known dataset name tells
        absent = middle[1] if given and given[0] in DATASETS else middle[0] if given else " and ".join(middle)
        raise ReleaseError(f"{where}: the {absent} component is missing ({template})")
    if len(given) > len(middle):
        raise ReleaseError(f"{where}: {len(rest)} components, expected {template}")
    block = int(rest[2])
    if kind == "single_block_size":
        return ReleaseSetting("blockgen", PRIORS[rest[-1]], (block,), (1.0,), False, rest[3], where)
    sizes, weights = _mixture(rest[4], block, where)
    return ReleaseSetting("blockgen", PRIORS[rest[-1]], sizes, weights, True, rest[3], where)


def read_release_path(path: str | Path) -> tuple[ReleaseSetting, str | None]:
    """(the setting a release path encodes, None), or (an empty setting, why the path's last `baselines/`
    or `blockgen/` tail breaks the layout; None when it has no such component)."""
    parts = [p for p in Path(str(path)).parts if p not in ("", "/")]
    problem = None
    for start in range(len(parts) - 1, -1, -1):  # the last tail that follows the layout wins
        if parts[start] in ("baselines", "blockgen"):
            try:
                return _parse_tail(parts[start:]), None
            except ReleaseError as err:
                problem = problem or str(err)
    return ReleaseSetting(), problem


def parse_release_path(path: str | Path) -> ReleaseSetting:
    """The setting encoded by a release path (a hub subfolder or any local path that ends in one); a
    path that does not follow the layout gives an empty setting (everything must then come from overrides)."""
    return read_release_path(path)[0]


# ------------------------------------------------------------------------------ overrides


@dataclass(frozen=True)
class ReleaseOverrides:
    """Explicit settings (model args): required where the path says nothing, refused where they
    contradict the path, config.json or the weights."""

    algo: Algo | None = None
    prior: Literal["masked", "uniform"] | None = None
    block_sizes: tuple[int, ...] | None = None
    block_weights: tuple[float, ...] | None = None
    x0_causal: bool | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.algo is not None and self.algo not in ALGOS:
            raise ValueError(f"algo={self.algo!r}; choose one of {list(ALGOS)}")
        if self.prior is not None and self.prior not in ("masked", "uniform"):
            raise ValueError(f"prior={self.prior!r}; choose 'masked' (the release's 'absorb') or 'uniform'")

    @classmethod
    def from_model_args(cls, algo=None, prior=None, block_sizes=None, block_weights=None, x0_causal=None,
                        tokenizer=None) -> "ReleaseOverrides":
        """lm-eval model args are `key=value` pairs split at commas: lists are written `1:16`, `0.05:0.95`."""

        def numbers(value, kind, name):
            if value is None:
                return None
            try:
                return tuple(kind(v) for v in str(value).split(":"))
            except ValueError:
                raise ValueError(f"{name}={value!r}; write a list as values separated by ':' (e.g. 1:16)") from None

        if prior == "absorb":
            prior = "masked"
        return cls(algo, prior, numbers(block_sizes, int, "block_sizes"), numbers(block_weights, float, "block_weights"),
                   x0_causal, None if tokenizer is None else str(tokenizer))

    def given(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "tokenizer"}


def _merge(setting: ReleaseSetting, overrides: ReleaseOverrides, source: str, problem: str | None = None) -> ReleaseSetting:
    """The path's setting completed by the overrides; `problem`: why the path broke the layout."""
    values = asdict(setting)
    for key, value in overrides.given().items():
        if values[key] is not None and values[key] != value:
            shown = {"prior": {"masked": "absorb"}.get(values[key], values[key])}.get(key, values[key])
            raise ReleaseError(f"{source}: {key}={value} contradicts the release, whose path says {key}={shown}; "
                               f"drop the override (it is only needed where the path does not say it)")
        values[key] = value
    merged = ReleaseSetting(**values)
    if merged.algo is None:
        why = problem or "no baselines/<data>/<ar|mdlm|duo> or blockgen/... components"
        raise ReleaseError(f"{source}: the path does not follow the release layout of {HUB_REPO} ({why}); fix: name the "
                           f"folder as the hub's subfolder (`blockgen released names` lists them), or give algo= (one "
                           f"of {list(ALGOS)}) and prior=, block_sizes=, block_weights=")
    if merged.prior is None:
        merged = replace(merged, prior={"ar": "masked", "mdlm": "masked", "duo": "uniform"}.get(merged.algo))
    if merged.prior is None:
        raise ReleaseError(f"{source}: a BlockGen release needs prior= ('masked'/'absorb' or 'uniform')")
    expected = {"ar": "masked", "mdlm": "masked", "duo": "uniform"}.get(merged.algo)
    if expected and merged.prior != expected:
        raise ReleaseError(f"{source}: prior={merged.prior} contradicts algo={merged.algo} (its prior is {expected})")
    return merged


# ------------------------------------------------------------------------------ config and weights


def _vocab_rows(weights: dict[str, torch.Tensor], source: str) -> int:
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
    rows = _vocab_rows(weights, source)
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


# ------------------------------------------------------------------------------ where a release lives


def _read_config(folder: Path) -> tuple[dict | None, str]:
    """(config.json, "") when it is the authors' (a `type`, no `model_type`), else (what was read, or
    None, and why it is not a release's)."""
    path = folder / CONFIG
    if not path.is_file():
        return None, f"{path}: missing"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{path}: not valid JSON ({err})"
    if not isinstance(raw, dict):
        return None, f"{path}: a JSON {type(raw).__name__}, not an object"
    if "model_type" in raw or raw.get("type") not in ("block-dit", "dit"):
        return raw, f"{path}: type={raw.get('type')!r}, expected the authors' 'block-dit' or 'dit'"
    return raw, ""


def is_release_spec(pretrained: str | Path) -> bool:
    """`hf:...`, or a local folder whose config.json is the authors'."""
    text = str(pretrained)
    return text.startswith(HF_PREFIX) or not _read_config(Path(text))[1]


def fetch_hint(subfolder: str | None) -> str:
    """How to get a release's files again."""
    return (f"fetch the release's files again (`huggingface-cli download {HUB_REPO} --include "
            f"'{subfolder or '<subfolder>'}/*' --local-dir DIR`)")


def split_hf(spec: str) -> tuple[str, str]:
    """`hf:owner/name/<subfolder>` -> (repo, subfolder)."""
    parts = spec[len(HF_PREFIX):].strip("/").split("/")
    if len(parts) < 3:
        raise ReleaseError(f"{spec}: expected hf:{HUB_REPO}/<subfolder>, e.g. hf:{HUB_REPO}/blockgen/multi_block_size/16/owt/0.05_0.95/absorb")
    return "/".join(parts[:2]), "/".join(parts[2:])


def offline_message(spec: str, subfolder: str, repo: str = HUB_REPO) -> str:
    return (f"could not fetch {spec} ({repo}, subfolder {subfolder}). With a local copy, run offline: "
            f"`huggingface-cli download {repo} --include '{subfolder}/*' --local-dir DIR`, then either "
            f"pretrained=DIR/{subfolder} or {LOCAL_DIR_ENV}=DIR HF_HUB_OFFLINE=1 with pretrained={spec}. "
            f"Without the hub: {OFFLINE_HINT}")


def locate(pretrained: str | Path) -> tuple[Path, str]:
    """(local folder holding config.json and model.safetensors, source as recorded in results)."""
    text = str(pretrained)
    if not text.startswith(HF_PREFIX):
        folder = Path(text)
        for name in (CONFIG, WEIGHTS):
            if not (folder / name).is_file():
                raise ReleaseError(f"{folder / name}: missing (a release folder holds {CONFIG} and {WEIGHTS}); "
                                   f"fix: {fetch_hint(parse_release_path(folder).subfolder)}")
        return folder, str(folder.resolve())
    repo, subfolder = split_hf(text)
    setting, problem = read_release_path(subfolder)
    if repo == HUB_REPO and setting.algo is None:  # the hub holds the layout's subfolders only
        raise ReleaseError(f"{text}: {problem or 'no baselines/... or blockgen/... subfolder'}; fix: the hub's "
                           f"subfolders are listed by `blockgen released names`")
    local = os.environ.get(LOCAL_DIR_ENV)
    if local and all((Path(local) / subfolder / n).is_file() for n in (CONFIG, WEIGHTS)):
        return Path(local) / subfolder, text
    try:
        from huggingface_hub import hf_hub_download

        paths = [hf_hub_download(repo, name, subfolder=subfolder) for name in (CONFIG, WEIGHTS)]
    except Exception as err:  # offline, DNS, 404, a missing cache entry under HF_HUB_OFFLINE=1
        reason = " ".join(str(err).split())  # hub errors span lines: the message stays one
        raise HubUnavailableError(f"{offline_message(text, subfolder, repo)} ({type(err).__name__}: {reason})") from err
    return Path(paths[0]).parent, text


# ------------------------------------------------------------------------------ tokenizer


def release_rows(tokenizer, prior: str, gpt2: bool) -> int:
    """The authors' embedding rows for a tokenizer prepared as theirs ([PAD] added where it has none):
    absorb / MDLM / AR add the [MASK] row at their `vocab_size`, uniform / Duo have `len(tokenizer)` rows.
    Their `get_tokenizer` leaves gpt2 as it is (vocab_size 50257, len 50258: [MASK] is the added [PAD])
    and wraps every other tokenizer so that vocab_size == len."""
    if prior == "uniform":
        return len(tokenizer)
    return (tokenizer.vocab_size if gpt2 else len(tokenizer)) + 1


def release_tokenizer(name: str, rows: int, setting: ReleaseSetting, source: str, given: bool, prior_free: bool):
    """The tokenizer as the authors prepare it, checked against the embedding's rows. The layout (gpt2 or
    wrapped) follows the path's dataset; a path that names none takes either, the one the rows fit.
    `given`: the name is the user's tokenizer=; `prior_free`: prior= may still be chosen."""
    from blockgen.harness.checkpoints.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(name)
    except HubUnavailableError:
        if given:
            raise ReleaseError(f"tokenizer={name}: neither a folder with tokenizer files nor a hub name reachable "
                               f"from here; fix: tokenizer=<a folder with tokenizer.json, or vocab.json and merges.txt>") from None
        raise HubUnavailableError(f"{source}: its dataset {setting.dataset} reads the tokenizer {name}, which is neither "
                                  f"reachable on the hub nor in its cache; fix: tokenizer=<dir>, a local copy of {name} "
                                  f"(`huggingface-cli download {name} --local-dir DIR` where the hub is reachable)") from None
    added = tokenizer.pad_token is None
    if added:  # as the authors' get_tokenizer does
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    layouts = [setting.tokenizer == "gpt2"] if setting.tokenizer else [False, True]
    if any(release_rows(tokenizer, setting.prior, gpt2) == rows for gpt2 in layouts):
        return tokenizer
    want = " or ".join(str(n) for n in sorted({release_rows(tokenizer, setting.prior, gpt2) for gpt2 in layouts}))
    other = "uniform" if setting.prior == "masked" else "masked"
    if prior_free and any(release_rows(tokenizer, other, gpt2) == rows for gpt2 in layouts):
        fix = f"prior={other} (the rows fit it)"
    else:
        fix = "tokenizer=<dir> holding the tokenizer this model was trained with"
        fix += f" ({setting.tokenizer})" if setting.tokenizer else ""
    tokens = f"{len(tokenizer)} tokens{' with the added [PAD]' if added else ''}"
    raise ReleaseError(f"{source}/{WEIGHTS}: vocab_embed.embedding has {rows} rows, but the tokenizer {name} (vocab_size "
                       f"{tokenizer.vocab_size}, {tokens}) gives {want} for prior={setting.prior} (the authors' rule: "
                       f"uniform / Duo len(tokenizer), absorb / MDLM / AR vocab_size + 1, where vocab_size is "
                       f"len(tokenizer) for every tokenizer but gpt2); fix: {fix}")


# ------------------------------------------------------------------------------ import (convert once)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "blockgen" / "released")


def import_release(pretrained: str | Path, overrides: ReleaseOverrides = ReleaseOverrides(), out_dir: str | Path | None = None) -> Path:
    """Convert a release once into a checkpoint directory of this project (cached; returns its path).

    `out_dir` None: a folder under `cache_root()` keyed by the release files, the setting and the
    tokenizer, reused when it exists. The source is recorded under config.json's `training.source`.
    """
    from blockgen.harness.checkpoints.checkpoint import read_weights
    from blockgen.harness.checkpoints.tokenizer import special_tokens

    folder, source = locate(pretrained)
    text = str(pretrained)
    path_setting, problem = read_release_path(text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else folder)
    raw, config_problem = _read_config(folder)
    if config_problem:
        raise ReleaseError(f"{config_problem}; fix: {fetch_hint(path_setting.subfolder)}")
    setting = _merge(path_setting, overrides, source, problem)
    tokenizer_name = overrides.tokenizer or setting.tokenizer
    if tokenizer_name is None:
        raise ReleaseError(f"{source}: the path names no dataset with a known tokenizer ({sorted(DATASETS)}); "
                           f"fix: tokenizer=<directory or hub name>")
    key = hashlib.sha256(json.dumps([file_id(folder / CONFIG), file_id(folder / WEIGHTS), asdict(setting), source,
                                     _tokenizer_id(tokenizer_name)]).encode()).hexdigest()[:20]
    target = Path(out_dir) if out_dir is not None else cache_root() / key
    if out_dir is None and (target / CONFIG).is_file() and (target / WEIGHTS).is_file():
        return target
    weights = read_weights(folder / WEIGHTS, fetch_hint(setting.subfolder), ReleaseError)
    rows = _vocab_rows(weights, source)
    tokenizer = release_tokenizer(tokenizer_name, rows, setting, source, given=overrides.tokenizer is not None,
                                  prior_free=setting.algo == "blockgen" and path_setting.prior is None)
    config = release_config(raw, weights, setting, source, special_tokens(tokenizer).to_dict())
    state = map_weights(weights, config.shape.d_model // config.shape.n_heads, source)
    model = BlockGen(config)
    expected = model.state_dict()

    def authors(key: str) -> str:
        return rename(key, to_project=False) or key

    problems = [f"{authors(k)} is {list(state[k].shape)}, expected {list(expected[k].shape)}"
                for k in sorted(expected.keys() & state.keys()) if expected[k].shape != state[k].shape]
    problems += [f"{authors(k)} {list(expected[k].shape)} is missing" for k in sorted(expected.keys() - state.keys())]
    problems += [f"{authors(k)} is not expected" for k in sorted(state.keys() - expected.keys())]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ReleaseError(f"{source}/{WEIGHTS}: does not fit {CONFIG} ({setting.algo}, prior {setting.prior}): "
                           f"{'; '.join(problems[:4])}{more}; fix: {fetch_hint(setting.subfolder)}")
    model.load_state_dict(state)
    extra = {"source": source, "release": {**asdict(setting), "tokenizer": tokenizer_name, "config": raw}}
    if out_dir is not None:
        return save_checkpoint(target, model, tokenizer, extra=extra)
    # Several processes (torchrun ranks) may import the same release at once: each writes its own
    # folder and the first rename wins; the others' identical copies are dropped.
    mine = save_checkpoint(target.with_name(f"{target.name}.{os.getpid()}"), model, tokenizer, extra=extra)
    try:
        os.rename(mine, target)
    except OSError:
        shutil.rmtree(mine, ignore_errors=True)
    return target


def _tokenizer_id(name: str) -> str:
    """A local tokenizer folder's content identifies it (a hub name identifies itself)."""
    path = Path(name)
    if not path.is_dir():
        return name
    h = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(file.name.encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def resolve(pretrained: str | Path, overrides: ReleaseOverrides = ReleaseOverrides()) -> Path:
    """The checkpoint directory to load for `pretrained`: a release is imported (once), a checkpoint of
    this project is returned as it is (release overrides on it are an error)."""
    if is_release_spec(pretrained):
        return import_release(pretrained, overrides)
    names = sorted([*overrides.given(), *(["tokenizer"] if overrides.tokenizer else [])])
    if not names:
        return Path(pretrained)
    raw, problem = _read_config(Path(pretrained))
    if raw is not None and raw.get("model_type") == "blockgen":
        raise ReleaseError(f"pretrained={pretrained} is a checkpoint of this project: {names} apply to released "
                           f"checkpoints only (hf:{HUB_REPO}/<subfolder> or a release folder); fix: drop them")
    raise ReleaseError(f"{problem}; {names} take a release folder, which holds the authors' {CONFIG} beside {WEIGHTS}; "
                       f"fix: {fetch_hint(parse_release_path(pretrained).subfolder)}")


def resolve_model_args(model_args: dict) -> Path:
    """`resolve` from lm-eval's model args (what tasks receive as metadata): `pretrained` and the
    release overrides (tokenizer, algo, prior, block_sizes, block_weights, x0_causal); other keys ignored."""
    keys = ("algo", "prior", "block_sizes", "block_weights", "x0_causal", "tokenizer")
    overrides = ReleaseOverrides.from_model_args(**{k: model_args.get(k) for k in keys})
    return resolve(model_args["pretrained"], overrides)


def resolve_with_tokenizer(pretrained: str | Path, tokenizer) -> Path:
    """`resolve` for a caller that holds a tokenizer (training's `init_from`): a release whose path
    names no tokenizer is read with this one."""
    if not is_release_spec(pretrained):
        return Path(pretrained)
    text = str(pretrained)
    setting = parse_release_path(text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else text)
    if setting.tokenizer is not None:
        return import_release(pretrained)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return import_release(pretrained, ReleaseOverrides(tokenizer=folder))


def release_source(checkpoint: str | Path) -> str | None:
    """The release a converted checkpoint came from (config.json `training.source`), else None."""
    try:
        return json.loads((Path(checkpoint) / CONFIG).read_text())["training"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------ the paper's tables


def _blockgen(block: int, data: str, prior: str, weights: str | None = None) -> str:
    if weights is None:
        return f"blockgen/single_block_size/{block}/{data}/{prior}"
    return f"blockgen/multi_block_size/{block}/{data}/{weights}/{prior}"


# The released subfolder of each model of the paper's tables, under this project's model names (the
# training presets `<benchmark>-<variant>` of harness/training/presets.py and the rows of leaderboards/paper.json).
# Mixtures without a preset of their own are named by their gamma_1 (`-g0.01`).
RELEASES: dict[str, str] = {
    **{f"{d}-{algo}": f"baselines/{d}/{algo}" for d in ("owt", "tinygsm") for algo in ("ar", "mdlm", "duo")},
    **{f"owt-{p}-16": _blockgen(16, "owt", r) for p, r in (("masked", "absorb"), ("uniform", "uniform"))},
    **{f"owt-{p}-mix": _blockgen(16, "owt", r, "0.05_0.95") for p, r in (("masked", "absorb"), ("uniform", "uniform"))},
    **{f"owt-{p}-mix-flat": _blockgen(16, "owt", r, "uniform") for p, r in (("masked", "absorb"), ("uniform", "uniform"))},
    **{f"tinygsm-{p}-{b}": _blockgen(b, "tinygsm", r) for p, r in (("masked", "absorb"), ("uniform", "uniform")) for b in (16, 32)},
    **{f"tinygsm-{p}-mix": _blockgen(16, "tinygsm", r, "0.05_0.95") for p, r in (("masked", "absorb"), ("uniform", "uniform"))},
    **{f"tinygsm-{p}-mix32": _blockgen(32, "tinygsm", r, "0.05_0.95") for p, r in (("masked", "absorb"), ("uniform", "uniform"))},
    **{f"tinygsm-{p}-mix-g{g}": _blockgen(16, "tinygsm", r, w) for p, r in (("masked", "absorb"), ("uniform", "uniform"))
       for g, w in (("0.01", "0.01_0.99"), ("0.1", "0.1_0.9"))},
    **{f"tinygsm-{p}-mix32-g0.01": _blockgen(32, "tinygsm", r, "0.01_0.99") for p, r in (("masked", "absorb"), ("uniform", "uniform"))},
}


def release_spec(name: str) -> str:
    if name not in RELEASES:
        raise ValueError(f"no released checkpoint named {name!r}; choose one of {sorted(RELEASES)}")
    return f"{HF_PREFIX}{HUB_REPO}/{RELEASES[name]}"


def check_on_hub(names: list[str]) -> None:
    """Raise HubUnavailableError unless the hub (or $BLOCKGEN_RELEASE_DIR) has every named release's two files."""
    local = os.environ.get(LOCAL_DIR_ENV)
    wanted = [(name, RELEASES[name]) for name in names if release_spec(name)]
    if local:
        wanted = [(n, sub) for n, sub in wanted if not all((Path(local) / sub / f).is_file() for f in (CONFIG, WEIGHTS))]
    if not wanted:
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise HubUnavailableError(f"HF_HUB_OFFLINE is set and {LOCAL_DIR_ENV} lacks {[n for n, _ in wanted]}")
    from huggingface_hub import HfApi

    api = HfApi()
    for name, sub in wanted:
        for file in (CONFIG, WEIGHTS):
            try:
                found = api.file_exists(HUB_REPO, f"{sub}/{file}")
            except Exception as err:  # network errors, DNS: cannot use it from here
                raise HubUnavailableError(offline_message(release_spec(name), sub)) from err
            if not found:
                raise HubUnavailableError(f"{HUB_REPO} has no {sub}/{file} (model {name})")


def add_import_arguments(parser) -> None:
    """`blockgen import` and `blockgen released import`."""
    parser.add_argument("specs", nargs="+", help="hf:jdeschena/blockgen/<subfolder>, a release folder, or a name of `names`")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--out-dir", default=None, help="one spec only: write the checkpoint here instead of the cache")


def run_import(args) -> int:
    if args.out_dir and len(args.specs) != 1:
        print("blockgen import: error: --out-dir takes one spec", file=sys.stderr)
        return 2
    for spec in args.specs:
        spec = release_spec(spec) if spec in RELEASES else spec
        try:
            print(import_release(spec, ReleaseOverrides(tokenizer=args.tokenizer), args.out_dir))
        except (CheckpointError, HubUnavailableError) as err:  # ReleaseError included: one line, not a traceback
            print(f"blockgen import: error: {err}", file=sys.stderr)
            return 1
    return 0


def build_parser(parser) -> None:
    """`blockgen released names|check|import` (mounted by harness/cli.py). A grid's cost on the releases is
    `blockgen sweep released-owt --dry-run` (harness/evaluation/sweep.py, with `plan_cost` above)."""
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("names", help="print name=subfolder for every release (the Makefile reads it)")
    check = sub.add_parser("check", help="exit 1 unless the hub (or $%s) has these releases" % LOCAL_DIR_ENV)
    check.add_argument("names", nargs="+")
    check.add_argument("--hint", default="")
    add_import_arguments(sub.add_parser("import", help="convert releases once into checkpoint folders (prints each folder)"))


def run(args) -> int:
    if args.action == "names":
        print(" ".join(f"{name}={sub_}" for name, sub_ in RELEASES.items()))
        return 0
    if args.action == "check":
        try:
            check_on_hub(args.names)
        except (HubUnavailableError, ValueError) as err:
            print(f"blockgen: the released checkpoints are needed here and unavailable: {err}\n{args.hint}", file=sys.stderr)
            return 1
        return 0
    return run_import(args)
