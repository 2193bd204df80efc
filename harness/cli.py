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

Every subcommand is listed here (`SUBCOMMANDS`); a module with its own subcommand contributes
`build_parser(parser)` and `run(args)` (harness/evaluation/: sample.py, sweep.py, vllm_server.py, paper_variants.py;
harness/reports/: regression.py, leaderboard_command.py, curves.py; harness/checkpoints/release_catalogue.py;
harness/data/hub_standin_repos.py). Only the subcommand run is mounted, so each pays for its own imports alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import typing
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Literal, get_args, get_origin

from blockgen.harness.runtime.flags import flag

if TYPE_CHECKING:
    from blockgen.harness.training.train_config import TrainConfig

Runner = Callable[[argparse.Namespace], int]


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
        option = flag(prefix + f.name)
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
        parser.add_argument(option, **kwargs)


def from_args(base: Any, given: dict[str, Any]) -> Any:
    """`base` (a config dataclass) with the options given (`add_dataclass_options`): `data.NAME` into its
    nested `data`, lists (nargs="+") as tuples. The one way a subcommand turns its flags into a config."""
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    nested = {k.split(".", 1)[1]: given.pop(k) for k in list(given) if k.startswith("data.")}
    return replace(base, **given, **({"data": replace(base.data, **nested)} if nested else {}))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A training config: `--preset` with the training flags given."""
    from blockgen.harness.training.presets import preset

    return from_args(preset(args.preset), {k: v for k, v in vars(args).items() if k not in ("subcommand", "preset")})


# ------------------------------------------------------------------------------ subcommands
# Each subcommand is mounted (its options added, its module imported) only when it is the one run, or when the
# whole parser is built (`build_parser()`, for the tests and the docs' checks): `blockgen --help` and the
# commands that read JSON (leaderboard, regression, curves) never import torch.

def _preset_option(parser: argparse.ArgumentParser) -> None:
    from blockgen.harness.training.presets import PRESETS

    parser.add_argument("--preset", default="gsm-masked", choices=sorted(PRESETS), metavar="NAME",
                        help="the training recipe to start from (default: %(default)s; `blockgen presets` lists them)")


def _mount_train(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.training.train_config import TrainConfig

    _preset_option(p)
    add_dataclass_options(p, TrainConfig)
    return _train


def _mount_demo(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.data.wordproblems import DIFFICULTIES
    from blockgen.harness.demo import DemoConfig
    from blockgen.harness.training.presets import PRESETS

    p.add_argument("--out-dir", default=DemoConfig.out_dir)
    p.add_argument("--max-steps", type=int, default=None, help="override every preset's step count")
    p.add_argument("--presets", nargs="+", default=list(DemoConfig.presets), choices=sorted(PRESETS), metavar="NAME",
                   help="the presets to train and sweep (default: %(default)s)")
    p.add_argument("--problems", type=int, default=DemoConfig.problems, help="held-out test problems per evaluation")
    p.add_argument("--jobs", type=int, default=DemoConfig.jobs, help="worker processes, one thread each (0: one per usable core)")
    p.add_argument("--temperatures", type=float, nargs="+", default=list(DemoConfig.temperatures),
                   help="sampling temperatures of the sweep (the paper's GSM8K runs use 1.0)")
    p.add_argument("--nfes", type=int, nargs="+", default=list(DemoConfig.nfes), help="NFE per block of the sweep")
    p.add_argument("--language-prompts", type=int, default=DemoConfig.language_prompts,
                   help="held-out prompts per setting of the synthetic language's models (lang-*)")
    p.add_argument("--language-nfes", type=int, nargs="+", default=list(DemoConfig.language_nfes),
                   help="NFE per block of 16 of the synthetic language's sweep")
    p.add_argument("--difficulty", choices=sorted(DIFFICULTIES), default=None,
                   help="the word-problem generator's level (default: the presets', 'easy')")
    p.add_argument("--seeds", type=int, nargs="+", default=list(DemoConfig.seeds),
                   help="training seeds: every model trains once per seed (seed s > 0 under OUT_DIR/seed-s); "
                        "with several, the findings across runs -> OUT_DIR/findings.json and each model's "
                        "held-out NLL across the seeds -> OUT_DIR/training-spread.json")
    p.add_argument("--train-only", action="store_true",
                   help="train the models and measure their held-out likelihood, without the sampler sweep "
                        "(with several --seeds: is training robust to the seed?)")
    return _demo


def _mount_presets(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("--json", action="store_true", help="every setting of every preset, as one JSON object by name")
    return _presets


def _mount_gpu_check(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.gpu_check.config import GpuCheckConfig

    add_dataclass_options(p, GpuCheckConfig)
    return _gpu_check


def _mount_train_scorer(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.training.train_scorer import ScorerTrainConfig

    add_dataclass_options(p, ScorerTrainConfig)
    return _train_scorer


def _mount_prepare_data(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.training.train_config import TrainConfig

    _preset_option(p)
    add_dataclass_options(p, TrainConfig)  # the training flags: the same --data.* and --seq-len give the same cache
    return _prepare_data


def _mount_train_cost(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.training.presets import PRESETS
    from blockgen.harness.training.train_config import TrainConfig

    p.add_argument("--presets", nargs="+", required=True, choices=sorted(PRESETS), metavar="NAME",
                   help="the runs, in order (`blockgen presets` lists them)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of each run: nodes x GPUs per node")
    p.add_argument("--runs", default="runs", help="runs folder: RUNS/<preset>/checkpoint's steps are done; "
                   "RUNS/gpu-check/rates.json prices the runs when it was measured on the GPU")
    p.add_argument("--rates", default=None, help="a rates file (default: gpu-check's, else the stored H100 figures)")
    add_dataclass_options(p, TrainConfig)  # the training flags (--max-steps, --batch-size, ...) apply to every preset
    return _train_cost


def _mount_hub_check(p: argparse.ArgumentParser) -> Runner:
    from blockgen.harness.training.presets import PRESETS

    p.add_argument("--presets", nargs="*", default=[], choices=sorted(PRESETS), metavar="NAME",
                   help="check what these presets' training loads: the dataset's files at its revision and the tokenizer")
    p.add_argument("--datasets", nargs="*", default=[], help="datasets (main revision) to check for loadable data files")
    p.add_argument("--models", nargs="*", default=[], help="models whose weights and tokenizer evaluation loads")
    p.add_argument("--tokenizers", nargs="*", default=[], help="models of which only the tokenizer is loaded")
    p.add_argument("--hint", default="", help="what to run instead (printed when the hub is unreachable)")
    return _hub_check


@dataclass(frozen=True)
class OwnedBy:
    """A subcommand whose options and work live in one module of blockgen.harness: `build(parser)` adds its
    options, `run(args)` runs it. Its description: `description`, else the module's COMMAND_HELP, else its
    docstring."""

    module: str
    description: str | None = None
    build: str = "build_parser"
    run: str = "run"

    def __call__(self, p: argparse.ArgumentParser) -> Runner:
        module = importlib.import_module(f"blockgen.harness.{self.module}")
        p.description = self.description or getattr(module, "COMMAND_HELP", module.__doc__)
        getattr(module, self.build)(p)
        return getattr(module, self.run)


@dataclass(frozen=True)
class Subcommand:
    """`blockgen NAME`: its line in `blockgen --help`, and `mount`, which adds its options to its parser and
    returns its runner ((parsed arguments) -> exit status)."""

    help: str
    mount: Callable[[argparse.ArgumentParser], Runner]


SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand("train (or resume) one model", _mount_train),
    "demo": Subcommand("the embedded default: train the demo models offline on CPU, sweep the samplers", _mount_demo),
    "presets": Subcommand("list the training presets as a table", _mount_presets),
    "gpu-check": Subcommand("first run on a GPU (micro size on CPU), in one time budget (--budget-s, 480 s): training, "
                            "DDP, generate(), lm_eval, scorers -> one JSON summary and a table", _mount_gpu_check),
    "train-scorer": Subcommand("train the small offline GPT-2 scorer (Hugging Face layout) for owt_genppl", _mount_train_scorer),
    "sample": Subcommand("sample from a checkpoint", OwnedBy("evaluation.sample")),
    "prepare-data": Subcommand("tokenize a preset's data into the memory-mapped cache training reads (run before torchrun)",
                               _mount_prepare_data),
    "train-cost": Subcommand("what training the given presets will cost on GPUs (measured rates), before it starts: per "
                             "model and in all, GPU-hours", _mount_train_cost),
    "hub-check": Subcommand("exit 1 with a message unless the hub serves the given datasets and models", _mount_hub_check),
    "hub-standin": Subcommand("a Hugging Face hub on 127.0.0.1 serving local folders (prints the HF_ENDPOINT)",
                              OwnedBy("data.hub_standin_repos")),
    "import": Subcommand("convert a released checkpoint (hf:jdeschena/blockgen/<subfolder>) once",
                         OwnedBy("checkpoints.release_catalogue", "Convert the paper's released checkpoints once into "
                                 "checkpoint folders (cached).", build="add_import_arguments", run="run_import")),
    "released": Subcommand("the paper's released checkpoints: names, hub check, conversion",
                           OwnedBy("checkpoints.release_catalogue", "The paper's released checkpoints. A grid's cost on "
                                   "them: `blockgen sweep released-owt --dry-run`.")),
    "sweep": Subcommand("a benchmark's sampler x NFE x temperature grid, one model load per checkpoint",
                        OwnedBy("evaluation.sweep")),
    "leaderboard": Subcommand("leaderboard JSON: add lm-eval results, show a table, plot, HTML page, compare two "
                              "settings, check against a reference", OwnedBy("reports.leaderboard_command")),
    "regression": Subcommand("CI regression: compare a rerun with a stored reference (a leaderboard with tolerances, or "
                             "gsm8k_code's per-problem outcomes), or rewrite it", OwnedBy("reports.regression")),
    "scorers": Subcommand("owt_genppl's scorers: which vLLM build the server uses",
                          OwnedBy("evaluation.vllm_server", "owt_genppl's scorer server: `blockgen scorers check-vllm` "
                                  "says which vLLM build the server would use and whether it can serve the device asked for.")),
    "curves": Subcommand("training curves of runs side by side (loss, gradient norm, flagged spikes) -> PNG",
                         OwnedBy("reports.curves", run="main")),
    "variants": Subcommand("the paper's sampler variants (steps:ge:warmup) by NFE per block", OwnedBy("evaluation.paper_variants")),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `blockgen` parser: every subcommand listed, and mounted (options, runner) all of them, or `only` that one."""
    parser, _ = _parser_and_runners(list(SUBCOMMANDS) if only is None else [only])
    return parser


def _parser_and_runners(mounted: list[str]) -> tuple[argparse.ArgumentParser, dict[str, Runner]]:
    parser = argparse.ArgumentParser(prog="blockgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    runners = {}
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name in mounted:
            runners[name] = command.mount(p)
    return parser, runners


# ------------------------------------------------------------------------------ main

# The subcommands whose work is done here (the others' runners are their modules').
def _presets(args: argparse.Namespace) -> int:
    from blockgen.harness.training.presets import PRESETS, preset_table

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
    from blockgen.harness.training.train_scorer import ScorerTrainConfig, train_scorer

    try:
        config = from_args(ScorerTrainConfig(), {k: v for k, v in vars(args).items() if k != "subcommand"})
    except ValueError as err:
        print(f"blockgen train-scorer: error: {err}", file=sys.stderr)
        return 2
    print(f"scorer: {train_scorer(config)}")
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from blockgen.harness.data.prepare import prepare_data

    config = config_from_args(args)
    print(f"prepared: {prepare_data(config.data, config.seq_len)}")
    return 0


def _hub_check(args: argparse.Namespace) -> int:
    from blockgen.harness.checkpoints.hub import HubUnavailableError, check_files
    from blockgen.harness.data.sources import LOCAL_TOKENIZER
    from blockgen.harness.training.presets import preset

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
    from blockgen.harness.gpu_check.config import GpuCheckConfig
    from blockgen.harness.gpu_check.summary import summary_table

    try:
        config = from_args(GpuCheckConfig(), {k: v for k, v in vars(args).items() if k != "subcommand"})
    except ValueError as err:
        print(f"blockgen gpu-check: error: {err}", file=sys.stderr)
        return 2
    summary = run_gpu_check(config)
    print(json.dumps(summary, indent=2))
    print("\n" + summary_table(summary), file=sys.stderr)  # stdout stays one JSON document
    for name in summary["failed"]:  # the verdict and its fix where a human reads it, after the JSON
        stage = summary["stages"][name]
        why = stage.get("error") or stage.get("skipped") or stage.get("truncated") or "a run failed (see its runs)"
        print(f"blockgen gpu-check: stage {name} failed: {why.splitlines()[0]}"
              + (f"\n  fix: {stage['fix']}" if "fix" in stage else ""), file=sys.stderr)
    return 0 if summary["ok"] else 1


def _demo(args: argparse.Namespace) -> int:
    from blockgen.harness.demo import DemoConfig, run_demo

    try:  # the settings alone: an error of the run itself keeps its traceback
        config = DemoConfig(out_dir=args.out_dir, presets=tuple(args.presets), max_steps=args.max_steps, problems=args.problems,
                            jobs=args.jobs, temperatures=tuple(args.temperatures), nfes=tuple(args.nfes),
                            difficulty=args.difficulty, seeds=tuple(args.seeds), language_prompts=args.language_prompts,
                            language_nfes=tuple(args.language_nfes), train_only=args.train_only)
    except ValueError as err:
        print(f"blockgen demo: error: {err}", file=sys.stderr)
        return 2
    run_demo(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if not a.startswith("-")), None)  # the subcommand (the top level has no valued option)
    parser, runners = _parser_and_runners([named] if named in SUBCOMMANDS else [])  # none: argparse says what is wrong
    args = parser.parse_args(argv)
    return runners[args.subcommand](args)


if __name__ == "__main__":
    sys.exit(main())
