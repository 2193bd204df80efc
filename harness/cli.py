"""The `blockgen` command line. Options are generated from the typed config dataclasses.

    blockgen train --preset gsm-masked-mix --out-dir runs/masked-mix --max-steps 2000
    torchrun --nproc_per_node=2 -m blockgen.harness.cli train --preset ci --device cpu
    blockgen demo                      # the embedded default: train and evaluate the three demo models
    blockgen sample --checkpoint DIR --prompt "..." --sampler arpc --steps 6 --ge 3
    blockgen presets                   # the presets as a table (--json: every setting)
    blockgen gpu-check                 # first run on a GPU: one JSON summary (micro size on CPU)
    blockgen prepare-data --preset owt-masked-mix   # tokenize the data once, before torchrun (same flags as train)
    blockgen train-cost --presets owt-ar owt-masked-mix --gpus 8 --device cuda   # GPU-hours before training starts
    blockgen train-scorer --out-dir runs/scorer-text   # the offline GPT-2 scorer for owt_genppl_embedded
    blockgen leaderboard add RESULTS.json --to board.json; blockgen leaderboard show|plot|page|compare board.json
    blockgen leaderboard collect runs/results --to board.json   # every results file under the roots (a sharded sweep's)
    blockgen import hf:jdeschena/blockgen/<subfolder>   # convert a released checkpoint once (cached)
    blockgen released names|check|import                # the paper's releases: names, hub check, conversion
    blockgen sweep owt-embedded --runs runs --dry-run    # a benchmark's grid: one model load per checkpoint, one scorer
    blockgen sweep owt --shard 3/8 --keep-going          # job 3 of 8 independent jobs over the grid
    blockgen regression check --against leaderboards/ci_regression.json NEW.json   # CI: a leaderboard against its tolerances
    blockgen regression check --against leaderboards/ci_gsm8k   # CI: gsm8k_code rerun, per-problem outcomes against the stored
    blockgen scorers check-vllm --device cuda           # which vLLM build owt_genppl's scorer server uses
    blockgen variants arpc --nfe 4 8                    # the paper's sampler variants by NFE per block
    blockgen hub-standin --root runs/hub                # a hub on the loopback serving local folders: export its HF_ENDPOINT

Every subcommand is defined here; a module with its own subcommand contributes `build_parser(parser)`
and `run(args)` (harness/evaluation/: sample.py, sweep.py, vllm_server.py, paper_variants.py; harness/reports/:
regression.py, leaderboard_command.py; harness/checkpoints/release_catalogue.py; harness/data/hub_standin_repos.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable, Literal, get_args, get_origin

from blockgen.harness.reports import curves, leaderboard, leaderboard_command, regression
from blockgen.harness.checkpoints import release_catalogue
from blockgen.harness.data import hub_standin_repos
from blockgen.harness.evaluation import sample, paper_variants, sweep, vllm_server
from blockgen.harness.data.sources import LOCAL_TOKENIZER
from blockgen.harness.demo import DemoConfig
from blockgen.harness.gpu_check.config import GpuCheckConfig
from blockgen.harness.training.presets import PRESETS, preset, preset_table
from blockgen.harness.training.train_config import TrainConfig
from blockgen.harness.training.train_scorer import ScorerTrainConfig
from blockgen.harness.data.wordproblems import DIFFICULTIES


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


def from_args(base: Any, given: dict[str, Any]) -> Any:
    """`base` (a config dataclass) with the options given (`add_dataclass_options`): `data.NAME` into its
    nested `data`, lists (nargs="+") as tuples. The one way a subcommand turns its flags into a config."""
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    nested = {k.split(".", 1)[1]: given.pop(k) for k in list(given) if k.startswith("data.")}
    return replace(base, **given, **({"data": replace(base.data, **nested)} if nested else {}))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A training config: `--preset` with the training flags given."""
    return from_args(preset(args.preset), {k: v for k, v in vars(args).items() if k not in ("subcommand", "preset")})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    train_p = sub.add_parser("train", help="train (or resume) one model")
    train_p.add_argument("--preset", default="gsm-masked", choices=sorted(PRESETS), metavar="NAME",
                         help="the training recipe to start from (default: %(default)s; `blockgen presets` lists them)")
    add_dataclass_options(train_p, TrainConfig)
    demo_p = sub.add_parser("demo", help="the embedded default: train the demo models offline on CPU, sweep the samplers")
    demo_p.add_argument("--out-dir", default=DemoConfig.out_dir)
    demo_p.add_argument("--max-steps", type=int, default=None, help="override every preset's step count")
    demo_p.add_argument("--presets", nargs="+", default=list(DemoConfig.presets), choices=sorted(PRESETS), metavar="NAME",
                        help="the presets to train and sweep (default: %(default)s)")
    demo_p.add_argument("--problems", type=int, default=DemoConfig.problems, help="held-out test problems per evaluation")
    demo_p.add_argument("--jobs", type=int, default=DemoConfig.jobs, help="worker processes, one thread each (0: one per usable core)")
    demo_p.add_argument("--temperatures", type=float, nargs="+", default=list(DemoConfig.temperatures),
                        help="sampling temperatures of the sweep (the paper's GSM8K runs use 1.0)")
    demo_p.add_argument("--nfes", type=int, nargs="+", default=list(DemoConfig.nfes), help="NFE per block of the sweep")
    demo_p.add_argument("--language-prompts", type=int, default=DemoConfig.language_prompts,
                        help="held-out prompts per setting of the synthetic language's models (lang-*)")
    demo_p.add_argument("--language-nfes", type=int, nargs="+", default=list(DemoConfig.language_nfes),
                        help="NFE per block of 16 of the synthetic language's sweep")
    demo_p.add_argument("--difficulty", choices=sorted(DIFFICULTIES), default=None,
                        help="the word-problem generator's level (default: the presets', 'easy')")
    demo_p.add_argument("--seeds", type=int, nargs="+", default=list(DemoConfig.seeds),
                        help="training seeds: every model trains once per seed (seed s > 0 under OUT_DIR/seed-s); "
                             "with several, the findings across runs -> OUT_DIR/findings.json and each model's "
                             "held-out NLL across the seeds -> OUT_DIR/training-spread.json")
    demo_p.add_argument("--train-only", action="store_true",
                        help="train the models and measure their held-out likelihood, without the sampler sweep "
                             "(with several --seeds: is training robust to the seed?)")
    sub.add_parser("presets", help="list the training presets as a table").add_argument(
        "--json", action="store_true", help="every setting of every preset, as one JSON object by name")
    check_p = sub.add_parser("gpu-check", help="first run on a GPU (micro size on CPU), in one time budget (--budget-s, 480 s): "
                             "training, DDP, generate(), lm_eval, scorers -> one JSON summary and a table")
    add_dataclass_options(check_p, GpuCheckConfig)
    scorer_p = sub.add_parser("train-scorer", help="train the small offline GPT-2 scorer (Hugging Face layout) for owt_genppl")
    add_dataclass_options(scorer_p, ScorerTrainConfig)
    sample.build_parser(_mounted(sub, "sample", "sample from a checkpoint", sample.__doc__))
    prep_p = sub.add_parser("prepare-data", help="tokenize a preset's data into the memory-mapped cache training reads (run before torchrun)")
    prep_p.add_argument("--preset", default="gsm-masked", choices=sorted(PRESETS), metavar="NAME",
                         help="the training recipe to start from (default: %(default)s; `blockgen presets` lists them)")
    add_dataclass_options(prep_p, TrainConfig)  # the training flags: the same --data.* and --seq-len give the same cache
    cost_p = sub.add_parser("train-cost", help="what training the given presets will cost on GPUs (measured rates), "
                            "before it starts: per model and in all, GPU-hours")
    cost_p.add_argument("--presets", nargs="+", required=True, choices=sorted(PRESETS), metavar="NAME",
                        help="the runs, in order (`blockgen presets` lists them)")
    cost_p.add_argument("--gpus", type=int, required=True, help="GPUs of each run: nodes x GPUs per node")
    cost_p.add_argument("--runs", default="runs", help="runs folder: RUNS/<preset>/checkpoint's steps are done; "
                        "RUNS/gpu-check/rates.json prices the runs when it was measured on the GPU")
    cost_p.add_argument("--rates", default=None, help="a rates file (default: gpu-check's, else the stored H100 figures)")
    add_dataclass_options(cost_p, TrainConfig)  # the training flags (--max-steps, --batch-size, ...) apply to every preset
    hub_p = sub.add_parser("hub-check", help="exit 1 with a message unless the hub serves the given datasets and models")
    hub_p.add_argument("--presets", nargs="*", default=[], choices=sorted(PRESETS), metavar="NAME",
                       help="check what these presets' training loads: the dataset's files at its revision and the tokenizer")
    hub_p.add_argument("--datasets", nargs="*", default=[], help="datasets (main revision) to check for loadable data files")
    hub_p.add_argument("--models", nargs="*", default=[], help="models whose weights and tokenizer evaluation loads")
    hub_p.add_argument("--tokenizers", nargs="*", default=[], help="models of which only the tokenizer is loaded")
    hub_p.add_argument("--hint", default="", help="what to run instead (printed when the hub is unreachable)")
    hub_standin_repos.build_parser(_mounted(sub, "hub-standin", "a Hugging Face hub on 127.0.0.1 serving local folders (prints the HF_ENDPOINT)",
                                            hub_standin_repos.COMMAND_HELP))
    release_catalogue.add_import_arguments(_mounted(sub, "import", "convert a released checkpoint (hf:jdeschena/blockgen/<subfolder>) once",
                                           "Convert the paper's released checkpoints once into checkpoint folders (cached)."))
    release_catalogue.build_parser(_mounted(sub, "released", "the paper's released checkpoints: names, hub check, conversion",
                                   "The paper's released checkpoints. A grid's cost on them: `blockgen sweep released-owt --dry-run`."))
    sweep.build_parser(_mounted(sub, "sweep", "a benchmark's sampler x NFE x temperature grid, one model load per checkpoint",
                                sweep.COMMAND_HELP))
    leaderboard_command.build_parser(_mounted(sub, "leaderboard", "leaderboard JSON: add lm-eval results, show a table, plot, HTML page, "
                                 "compare two settings, check against a reference", leaderboard.__doc__))
    regression.build_parser(_mounted(sub, "regression", "CI regression: compare a rerun with a stored reference (a leaderboard "
                                     "with tolerances, or gsm8k_code's per-problem outcomes), or rewrite it", regression.__doc__))
    vllm_server.build_parser(_mounted(sub, "scorers", "owt_genppl's scorers: which vLLM build the server uses",
                                      "owt_genppl's scorer server: `blockgen scorers check-vllm` says which vLLM build "
                                      "the server would use and whether it can serve the device asked for."))
    curves.build_parser(_mounted(sub, "curves", "training curves of runs side by side (loss, gradient norm, flagged spikes) -> PNG",
                                 curves.__doc__))
    paper_variants.build_parser(_mounted(sub, "variants", "the paper's sampler variants (steps:ge:warmup) by NFE per block",
                                       paper_variants.__doc__))
    return parser


def _mounted(sub, name: str, helptext: str, description: str | None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=helptext, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


# ------------------------------------------------------------------------------ main

# The subcommands whose work lives in the module that mounted them (the others are run in `main`).
def _presets(args: argparse.Namespace) -> int:
    print(json.dumps({name: cfg.to_dict() for name, cfg in PRESETS.items()}, indent=1) if args.json else preset_table())
    return 0


def _train(args: argparse.Namespace) -> int:
    from blockgen.harness.checkpoints.checkpoint import CheckpointError
    from blockgen.harness.checkpoints.hub import HubUnavailableError
    from blockgen.harness.runtime.distributed import ranks_from_env
    from blockgen.harness.training.run_directory import RunDirectoryBusy
    from blockgen.harness.training.stop_signals import TrainingInterrupted, TrainingStopped
    from blockgen.harness.training.train import NonFiniteLoss, train

    try:  # the errors a user's settings or files cause: one line each, naming the choices
        checkpoint = train(config_from_args(args))
        if ranks_from_env().is_main:  # one line for a torchrun job, not one per process
            print(f"checkpoint: {checkpoint}")
    except (ValueError, CheckpointError, HubUnavailableError, RunDirectoryBusy) as err:
        print(f"blockgen train: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as stopped:  # SIGTERM / SIGUSR1 / SIGINT: saved and said so (train), exit 128 + the signal's number
        return stopped.exit_code
    except NonFiniteLoss:  # the step and the last checkpoint were said by train (rank 0) before any rank left
        return 1
    except TrainingInterrupted as interrupted:
        print(f"blockgen train: {interrupted}", file=sys.stderr)
        return interrupted.exit_code
    return 0


def _train_cost(args: argparse.Namespace) -> int:
    from blockgen.harness.costs.train_cost import report

    flags = {k: v for k, v in vars(args).items() if k not in ("presets", "gpus", "runs", "rates")}
    try:
        configs = {name: config_from_args(argparse.Namespace(**flags, preset=name)) for name in args.presets}
        print(report(configs, args.gpus, args.runs, args.rates))
    except ValueError as err:  # RatesError too
        print(f"blockgen train-cost: error: {err}", file=sys.stderr)
        return 2
    return 0


def _train_scorer(args: argparse.Namespace) -> int:
    from blockgen.harness.training.train_scorer import train_scorer

    given = {k: v for k, v in vars(args).items() if k != "subcommand"}
    print(f"scorer: {train_scorer(from_args(ScorerTrainConfig(), given))}")
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from blockgen.harness.data.prepare import prepare_data

    config = config_from_args(args)
    print(f"prepared: {prepare_data(config.data, config.seq_len)}")
    return 0


def _hub_check(args: argparse.Namespace) -> int:
    from blockgen.harness.checkpoints.hub import HubUnavailableError, check_files

    datasets, tokenizers = [(name, None, None) for name in args.datasets], list(args.tokenizers)
    for name in args.presets:
        data = preset(name).data
        if data.path is None and data.source in ("owt", "tinygsm"):
            datasets.append((*data.hub_dataset(), "train"))
        if data.tokenizer != LOCAL_TOKENIZER:
            tokenizers.append(data.tokenizer)
    try:
        check_files(list(dict.fromkeys(datasets)), list(dict.fromkeys(tokenizers)), args.models)
    except HubUnavailableError as err:
        print(f"blockgen: hub check failed: {err}.\n{args.hint}", file=sys.stderr)
        return 1
    return 0


def _gpu_check(args: argparse.Namespace) -> int:
    from blockgen.harness.gpu_check.check import run_gpu_check
    from blockgen.harness.gpu_check.summary import summary_table

    summary = run_gpu_check(from_args(GpuCheckConfig(), {k: v for k, v in vars(args).items() if k != "subcommand"}))
    print(json.dumps(summary, indent=2))
    print("\n" + summary_table(summary), file=sys.stderr)  # stdout stays one JSON document
    for name in summary["failed"]:  # the verdict and its fix where a human reads it, after the JSON
        stage = summary["stages"][name]
        why = stage.get("error") or stage.get("skipped") or stage.get("truncated") or "a run failed (see its runs)"
        print(f"blockgen gpu-check: stage {name} failed: {why.splitlines()[0]}"
              + (f"\n  fix: {stage['fix']}" if "fix" in stage else ""), file=sys.stderr)
    return 0 if summary["ok"] else 1


def _demo(args: argparse.Namespace) -> int:
    from blockgen.harness.demo import run_demo

    run_demo(DemoConfig(out_dir=args.out_dir, presets=tuple(args.presets), max_steps=args.max_steps, problems=args.problems,
                        jobs=args.jobs, temperatures=tuple(args.temperatures), nfes=tuple(args.nfes), difficulty=args.difficulty,
                        seeds=tuple(args.seeds), language_prompts=args.language_prompts, language_nfes=tuple(args.language_nfes),
                        train_only=args.train_only))
    return 0


# Every subcommand's runner: (parsed arguments) -> exit status.
RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train, "demo": _demo, "presets": _presets, "gpu-check": _gpu_check, "train-scorer": _train_scorer,
    "prepare-data": _prepare_data, "train-cost": _train_cost, "hub-check": _hub_check,
    "sample": sample.run, "import": release_catalogue.run_import, "released": release_catalogue.run, "sweep": sweep.run,
    "leaderboard": leaderboard_command.run, "regression": regression.run, "scorers": vllm_server.run,
    "variants": paper_variants.run, "curves": curves.main, "hub-standin": hub_standin_repos.run,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return RUNNERS[args.subcommand](args)


if __name__ == "__main__":
    sys.exit(main())
