"""The `blockgen` command line. Options are generated from the typed config dataclasses.

    blockgen train --preset gsm-masked-mix --out-dir runs/masked-mix --max-steps 2000
    torchrun --nproc_per_node=2 -m blockgen.harness.cli train --preset ci --device cpu
    blockgen demo                      # the embedded default: train and evaluate the five demo models
    blockgen sample --checkpoint DIR --prompt "..." --sampler arpc --steps 6 --ge 3
    blockgen presets                   # list presets and their settings
    blockgen gpu-check                 # first run on a GPU: one JSON summary (micro size on CPU)
    blockgen prepare-data --preset owt-masked-mix   # tokenize the data once, before torchrun (same flags as train)
    blockgen train-scorer --out-dir runs/scorer-text   # the offline GPT-2 scorer for owt_genppl_embedded
    blockgen leaderboard add RESULTS.json --to board.json; blockgen leaderboard show|plot|page board.json
    blockgen import hf:jdeschena/blockgen/<subfolder>   # convert a released checkpoint once (cached)
    blockgen released names|check|plan                  # the paper's releases: names, hub check, dry-run cost
    blockgen sweep owt-embedded --runs runs --dry-run    # a benchmark's grid: one model load per checkpoint, one scorer
    blockgen outcomes check                             # CI: gsm8k_code per-problem outcomes of leaderboards/ci_gsm8k/
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import fields, is_dataclass, replace
from typing import Any, Literal, get_args, get_origin

from blockgen.harness.demo import DemoConfig
from blockgen.harness.gpu_check import GpuCheckConfig
from blockgen.harness.train import DEMO_PRESETS, PRESETS, TrainConfig, preset
from blockgen.harness.train_scorer import ScorerTrainConfig
from blockgen.harness.wordproblems import DIFFICULTIES


def _is_optional(tp) -> tuple[bool, Any]:
    args = get_args(tp)
    if type(None) in args and len(args) == 2:
        return True, next(a for a in args if a is not type(None))
    return False, tp


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One `--name` option per field (nested dataclasses as `--data.name`); defaults come from presets."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        flag = "--" + prefix + f.name.replace("_", "-")
        if is_dataclass(tp):
            add_dataclass_options(parser, tp, prefix=f"{prefix}{f.name}.")
            continue
        _, tp = _is_optional(tp)
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": argparse.SUPPRESS}
        if get_origin(tp) is Literal:
            kwargs.update(choices=list(get_args(tp)))
        elif get_origin(tp) is tuple:
            kwargs.update(nargs="+", type=get_args(tp)[0])
        elif tp is bool:
            kwargs.update(action=argparse.BooleanOptionalAction)
        else:
            kwargs.update(type=tp)
        parser.add_argument(flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given = {k: v for k, v in vars(args).items() if k not in ("command", "preset")}
    data_over = {k.split(".", 1)[1]: given.pop(k) for k in list(given) if k.startswith("data.")}
    base = preset(args.preset)
    for key in ("block_sizes", "block_weights"):
        if key in given:
            given[key] = tuple(given[key])
    return replace(base, **given, data=replace(base.data, **data_over))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="train (or resume) one model")
    train_p.add_argument("--preset", default="gsm-masked", choices=sorted(PRESETS))
    add_dataclass_options(train_p, TrainConfig)
    demo_p = sub.add_parser("demo", help="the embedded default: train the demo models offline on CPU, sweep the samplers")
    demo_p.add_argument("--out-dir", default=DemoConfig.out_dir)
    demo_p.add_argument("--max-steps", type=int, default=None, help="override every preset's step count")
    demo_p.add_argument("--presets", nargs="+", default=list(DEMO_PRESETS), choices=sorted(PRESETS))
    demo_p.add_argument("--problems", type=int, default=DemoConfig.problems, help="held-out test problems per evaluation")
    demo_p.add_argument("--jobs", type=int, default=DemoConfig.jobs, help="worker processes, one thread each (0: one per usable core)")
    demo_p.add_argument("--temperatures", type=float, nargs="+", default=list(DemoConfig.temperatures),
                        help="sampling temperatures of the sweep (the paper's GSM8K runs use 1.0)")
    demo_p.add_argument("--nfes", type=int, nargs="+", default=list(DemoConfig.nfes), help="NFE per block of the sweep")
    demo_p.add_argument("--difficulty", choices=sorted(DIFFICULTIES), default=None,
                        help="the word-problem generator's level (default: the presets', 'easy')")
    sub.add_parser("presets", help="list the training presets")
    check_p = sub.add_parser("gpu-check", help="first run on a GPU (micro size on CPU): training, generate(), lm_eval, scorers -> one JSON summary")
    add_dataclass_options(check_p, GpuCheckConfig)
    scorer_p = sub.add_parser("train-scorer", help="train the small offline GPT-2 scorer (Hugging Face layout) for owt_genppl")
    add_dataclass_options(scorer_p, ScorerTrainConfig)
    sub.add_parser("sample", help="sample from a checkpoint (see `blockgen sample --help`)", add_help=False)
    prep_p = sub.add_parser("prepare-data", help="tokenize a preset's data into the memory-mapped cache training reads (run before torchrun)")
    prep_p.add_argument("--preset", default="gsm-masked", choices=sorted(PRESETS))
    add_dataclass_options(prep_p, TrainConfig)  # the training flags: the same --data.* and --seq-len give the same cache
    hub_p = sub.add_parser("hub-check", help="exit 1 with a message unless the hub serves the given datasets and models")
    hub_p.add_argument("--presets", nargs="*", default=[], choices=sorted(PRESETS),
                       help="check what these presets' training loads: the dataset's files at its revision and the tokenizer")
    hub_p.add_argument("--datasets", nargs="*", default=[], help="datasets (main revision) to check for loadable data files")
    hub_p.add_argument("--models", nargs="*", default=[], help="models whose weights and tokenizer evaluation loads")
    hub_p.add_argument("--hint", default="", help="what to run instead (printed when the hub is unreachable)")
    sub.add_parser("import", help="convert a released checkpoint (hf:jdeschena/blockgen/<subfolder>) once", add_help=False)
    sub.add_parser("released", help="the paper's released checkpoints: names, hub check, dry-run cost", add_help=False)
    sub.add_parser("sweep", help="a benchmark's sampler x NFE x temperature grid, one model load per checkpoint (see `blockgen sweep --help`)", add_help=False)
    sub.add_parser("leaderboard", help="leaderboard JSON: add lm-eval results, show a table, plot, HTML page (see `blockgen leaderboard --help`)", add_help=False)
    sub.add_parser("outcomes", help="CI regression of gsm8k_code by per-problem outcomes of a stored checkpoint (see `blockgen outcomes --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sample"]:  # its own parser: `blockgen sample --help`
        from blockgen.harness.sample import main as sample_main

        return sample_main(argv[1:])
    if argv[:1] in (["import"], ["released"]):  # the paper's released checkpoints (harness/released.py)
        from blockgen.harness.released import main as released_main

        return released_main(argv if argv[0] == "import" else argv[1:])
    if argv[:1] == ["sweep"]:  # its own parser: `blockgen sweep GRID [--dry-run]` (harness/sweep.py)
        from blockgen.harness.sweep import main as sweep_main

        return sweep_main(argv[1:])
    if argv[:1] == ["leaderboard"]:  # its own parser: `blockgen leaderboard add|show|plot`
        from blockgen.harness.leaderboard import main as leaderboard_main

        return leaderboard_main(argv[1:])
    if argv[:1] == ["outcomes"]:  # its own parser: `blockgen outcomes check|update` (harness/outcomes.py)
        from blockgen.harness.outcomes import main as outcomes_main

        return outcomes_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "presets":
        for name, cfg in PRESETS.items():
            print(name, json.dumps(cfg.to_dict()))
        return 0
    if args.command == "train":
        from blockgen.harness.train import train

        config = config_from_args(args)
        print(f"checkpoint: {train(config)}")
        return 0
    if args.command == "train-scorer":
        from blockgen.harness.train_scorer import train_scorer

        given = {k: v for k, v in vars(args).items() if k != "command"}
        data_over = {k.split(".", 1)[1]: given.pop(k) for k in list(given) if k.startswith("data.")}
        base = ScorerTrainConfig()
        print(f"scorer: {train_scorer(replace(base, **given, data=replace(base.data, **data_over)))}")
        return 0
    if args.command == "prepare-data":
        from blockgen.harness.prepare import prepare_data

        config = config_from_args(args)
        print(f"prepared: {prepare_data(config.data, config.seq_len)}")
        return 0
    if args.command == "hub-check":
        from blockgen.harness.hub import HubUnavailableError, check_files

        datasets, tokenizers = [(name, None, None) for name in args.datasets], []
        for name in args.presets:
            data = preset(name).data
            if data.path is None and data.source in ("owt", "tinygsm"):
                datasets.append((*data.hub_dataset(), "train"))
            if data.tokenizer != "embedded":
                tokenizers.append(data.tokenizer)
        try:
            check_files(list(dict.fromkeys(datasets)), list(dict.fromkeys(tokenizers)), args.models)
        except HubUnavailableError as err:
            print(f"blockgen: hub check failed: {err}.\n{args.hint}", file=sys.stderr)
            return 1
        return 0
    if args.command == "gpu-check":
        from blockgen.harness.gpu_check import run_gpu_check

        given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k != "command"}
        summary = run_gpu_check(GpuCheckConfig(**given))
        print(json.dumps(summary, indent=2))
        return 0 if summary["ok"] else 1
    if args.command == "demo":
        from blockgen.harness.demo import run_demo

        run_demo(DemoConfig(out_dir=args.out_dir, presets=tuple(args.presets), max_steps=args.max_steps, problems=args.problems,
                            jobs=args.jobs, temperatures=tuple(args.temperatures), nfes=tuple(args.nfes), difficulty=args.difficulty))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
