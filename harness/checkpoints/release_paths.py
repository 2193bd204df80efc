"""What a release of the paper's checkpoints (hub `jdeschena/blockgen`, one subfolder per model) says by
its path, and the model args that complete it. A release subfolder holds `config.json` (the authors'
model sub-config) and `model.safetensors` (the EMA backbone weights, the authors' key names); everything
else comes from the subfolder's path:

    baselines/<dataset>/{ar,mdlm,duo}
    blockgen/single_block_size/<bs>/<dataset>/{absorb,uniform}          block sizes {bs}, block-causal clean stream
    blockgen/multi_block_size/<bs>/<dataset>/<w>/{absorb,uniform}       w = "a_b": gamma_1 = a, gamma_bs = b;
                                                                        w = "uniform": equal weights on 1, 2, 4, ..., bs

`<dataset>` names the tokenizer (owt: gpt2, tinygsm: SmolLM-135M); a `tokenizer=` override serves local
copies and datasets without one (the test fixtures). Overrides (`ReleaseOverrides`) are required where
the path says nothing and refused where they contradict it (`merge_overrides`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from blockgen.harness.checkpoints.checkpoint import CheckpointError

HUB_REPO = "jdeschena/blockgen"
HF_PREFIX = "hf:"

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


def merge_overrides(setting: ReleaseSetting, overrides: ReleaseOverrides, source: str, problem: str | None = None) -> ReleaseSetting:
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
