"""This project inside lm-eval: the ``blockgen`` model and the task folder, and lm-eval's CLI with them.

lm-eval 0.4.13 has no plugin discovery. The start-up hook (``blockgen/_lm_eval_hook.py``) calls
`register_model` and `add_task_dir` as soon as lm-eval imports the modules they change, so the
plain ``lm_eval`` command sees ``--model blockgen`` and the ``blockgen_*`` tasks, `cache_builtin_index`
(lm-eval's own task index kept between runs: ``blockgen/lm_eval/task_index.py``), and
`check_before_evaluate`, so the model checks every task's settings before any request runs.

``python -m blockgen.lm_eval ...`` (or ``torchrun -m blockgen.lm_eval ...``) takes exactly
``lm_eval``'s arguments and registers directly, so it works without the hook too (``python -S``,
``BLOCKGEN_LM_EVAL_HOOK=0``, a site-packages that Python does not scan for .pth files).
"""

import functools
import inspect
import os
import sys
from pathlib import Path

from blockgen.lm_eval.task_index import cache_builtin_index

MODEL_NAME = "blockgen"
ADAPTER = "blockgen.harness.evaluation.lm_eval_model.model:BlockGenLM"
TASKS_PACKAGE = "blockgen.tasks"
TRACEBACK_ENV = "BLOCKGEN_TRACEBACK"  # =1: bad input under lm_eval shows its whole traceback again


def register_model(registry) -> None:
    """Register the adapter in `lm_eval.api.registry`, lazily: torch loads only when the model is used."""
    # lm-eval's own models first: get_model() adds them only while the registry is empty, so an
    # entry of ours alone would hide hf, vllm, ...
    import lm_eval.models  # noqa: F401

    if MODEL_NAME not in registry.model_registry:
        registry.model_registry.register(MODEL_NAME, target=ADAPTER)
    brief_input_errors()


def _ours(filename: str) -> bool:
    """A frame of this project's code (blockgen.harness, .models, .tasks), wherever installed."""
    import blockgen.harness
    import blockgen.models
    import blockgen.tasks

    roots = [Path(p.__file__).parent for p in (blockgen.harness, blockgen.models, blockgen.tasks)]
    return any(Path(filename).is_relative_to(root) for root in roots)


def brief_input_errors() -> None:
    """Bad input under ``lm_eval`` (a missing checkpoint, ``sampler=foo``, ``nfe=5``...) reaches the user as the
    project's one-block message, not a 30-line traceback whose last line it is. Only an error this project
    raised about its input: a ValueError, or an error class of its own, raised in its code; anything else (a
    bug of ours, every other model type's errors) goes to the hook that was there. ``BLOCKGEN_TRACEBACK=1``
    shows the traceback again."""
    previous = sys.excepthook
    if getattr(previous, "_blockgen_brief", False):
        return

    def hook(kind, value, tb):
        last = tb
        while last is not None and last.tb_next is not None:
            last = last.tb_next
        ours = last is not None and (issubclass(kind, ValueError) or kind.__module__.startswith("blockgen."))
        if ours and os.environ.get(TRACEBACK_ENV) != "1" and _ours(last.tb_frame.f_code.co_filename):
            print(f"\nlm_eval --model {MODEL_NAME}: error: {value}\n(the traceback: rerun with {TRACEBACK_ENV}=1)",
                  file=sys.stderr)
            return
        previous(kind, value, tb)

    hook._blockgen_brief = True
    sys.excepthook = hook


def tasks_dir() -> Path:
    from importlib.util import find_spec

    spec = find_spec(TASKS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{TASKS_PACKAGE} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def add_task_dir(manager) -> None:
    """Make every `lm_eval.tasks.manager.TaskManager` that indexes lm-eval's own tasks index ours too.

    Our folder goes right after lm-eval's and before any ``--include_path``, so a user's own task
    of the same name still wins. With ``include_defaults=False`` nothing is added.
    """
    cls = manager.TaskManager
    if getattr(cls.__init__, "_blockgen_tasks", False):
        return
    original = cls.__init__
    signature = inspect.signature(original)
    ours = tasks_dir()

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("include_defaults", True):
            given = bound.arguments.get("include_path")
            paths = list(given) if isinstance(given, (list, tuple)) else [] if given is None else [given]
            if all(Path(p).resolve() != ours for p in paths):
                bound.arguments["include_path"] = [str(ours), *paths]
        original(*bound.args, **bound.kwargs)

    __init__._blockgen_tasks = True
    cls.__init__ = __init__


def check_before_evaluate(evaluator) -> None:
    """Let a model check the tasks before any request is built or run: `lm_eval.evaluator.evaluate`
    first calls ``lm.check_tasks(task_dict)`` when the model has one (``blockgen`` validates every
    task's gen_kwargs there, so a bad one fails before hours of log-likelihood work)."""
    original = evaluator.evaluate
    if getattr(original, "_blockgen_checks", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        lm = bound.arguments.get("lm")
        check = getattr(getattr(lm, "lm", lm), "check_tasks", None)  # --use_cache wraps the model as .lm
        if callable(check):
            check(bound.arguments.get("task_dict"))
        return original(*args, **kwargs)

    evaluate._blockgen_checks = True
    evaluator.evaluate = evaluate


def remember_env_info(evaluator) -> None:
    """lm-eval records the environment in every result (`add_env_info`: torch's `collect_env`, which starts `pip list`
    and asks the system for its CPU and GPUs: 3-5 s on the 2-core machine). Within one process that report cannot
    change, so it is made once per working directory (it also records the git commit of the folder above) and
    copied into each later result: a sweep's settings after the first, CI's checks, the tests."""
    original = evaluator.add_env_info
    if getattr(original, "_blockgen_memo", False):
        return
    made: dict[str, dict] = {}

    @functools.wraps(original)
    def add_env_info(storage: dict) -> None:
        here = os.getcwd()
        if here not in made:
            made[here] = {}
            original(made[here])
        storage.update(made[here])

    add_env_info._blockgen_memo = True
    evaluator.add_env_info = add_env_info


def extend_evaluator(evaluator) -> None:
    """The start-up hook's entry for `lm_eval.evaluator`: `check_before_evaluate` and `remember_env_info`."""
    check_before_evaluate(evaluator)
    remember_env_info(evaluator)


def register() -> None:
    """Register the model and the task folder now (idempotent; errors are raised, not warned)."""
    import lm_eval.api.registry
    import lm_eval.evaluator
    import lm_eval.tasks._index
    import lm_eval.tasks.manager

    register_model(lm_eval.api.registry)
    cache_builtin_index(lm_eval.tasks._index)
    add_task_dir(lm_eval.tasks.manager)
    extend_evaluator(lm_eval.evaluator)


def main() -> None:
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
