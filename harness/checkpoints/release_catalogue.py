"""The paper's released checkpoints by this project's model names (`RELEASES`: name -> hub subfolder), the
check that the hub (or a local copy) has them, and the commands `blockgen released names|check|import`
and `blockgen import` (mounted by harness/cli.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from blockgen.harness.checkpoints.checkpoint import CONFIG, WEIGHTS, CheckpointError
from blockgen.harness.checkpoints.hub import HubUnavailableError
from blockgen.harness.checkpoints.release_import import LOCAL_DIR_ENV, import_release, offline_message
from blockgen.harness.checkpoints.release_paths import HF_PREFIX, HUB_REPO, ReleaseOverrides


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
    """Raise HubUnavailableError unless the hub (or $BLOCKGEN_RELEASE_DIR) has every named release's two files; with
    HF_HUB_OFFLINE set, unless $BLOCKGEN_RELEASE_DIR or the hub cache (an earlier online run's downloads) has them."""
    local = os.environ.get(LOCAL_DIR_ENV)
    wanted = [(name, RELEASES[name]) for name in names if release_spec(name)]
    if local:
        wanted = [(n, sub) for n, sub in wanted if not all((Path(local) / sub / f).is_file() for f in (CONFIG, WEIGHTS))]
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        from huggingface_hub import try_to_load_from_cache

        wanted = [(n, sub) for n, sub in wanted
                  if not all(isinstance(try_to_load_from_cache(HUB_REPO, f"{sub}/{f}"), str) for f in (CONFIG, WEIGHTS))]
        if wanted:
            raise HubUnavailableError(f"HF_HUB_OFFLINE is set and neither the hub cache nor {LOCAL_DIR_ENV} holds "
                                      f"{[n for n, _ in wanted]}")
    if not wanted:
        return
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
    `blockgen sweep released-owt --dry-run` (harness/evaluation/sweep.py, with `plan_cost` of harness/costs/eval_cost.py)."""
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("names", help="print name=subfolder for every release (the Makefile reads it)")
    check = sub.add_parser("check", help="exit 1 unless the hub (or $%s) has these releases" % LOCAL_DIR_ENV)
    check.add_argument("names", nargs="+", choices=sorted(RELEASES), metavar="NAME",
                       help="releases by name (`blockgen released names` lists them)")
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
