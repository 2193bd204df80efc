"""Start-up hook: the unmodified ``lm_eval`` command finds the ``blockgen`` model and this project's tasks.

lm-eval 0.4.13 discovers neither models nor tasks from installed packages. A one-line ``.pth``
file, installed into site-packages with this package (see ``blockgen/_pth_build.py``), calls
`install()` whenever Python starts, so this module stays small and imports nothing. `install()`
puts a finder at the front of ``sys.meta_path`` that waits for four lm-eval modules and, right
after each has executed, hands it to `blockgen.lm_eval` (which does the registering):
``lm_eval.api.registry`` -> ``register_model``, ``lm_eval.tasks._index`` -> ``cache_builtin_index``
(lm-eval's own task index kept on disk), ``lm_eval.tasks.manager`` -> ``add_task_dir``,
``lm_eval.evaluator`` -> ``extend_evaluator`` (``check_before_evaluate``, and ``remember_env_info``: the
environment report made once per process). Once all have been seen the finder removes itself.

A failure here must never break Python or lm-eval: it becomes a warning. ``BLOCKGEN_LM_EVAL_HOOK=0``
in the environment turns the hook off (``python -m blockgen.lm_eval`` registers by itself).
"""

import os
import sys

# lm-eval module -> the function of blockgen.lm_eval that is called with it once it has executed
WATCHED = {"lm_eval.api.registry": "register_model", "lm_eval.tasks._index": "cache_builtin_index",
           "lm_eval.tasks.manager": "add_task_dir", "lm_eval.evaluator": "extend_evaluator"}


def _warn(what: str, err: Exception) -> None:
    import warnings

    warnings.warn(f"blockgen could not {what} ({type(err).__name__}: {err}); "
                  "use `python -m blockgen.lm_eval ...` instead of `lm_eval ...`", RuntimeWarning, stacklevel=3)


def _run(name: str, module) -> None:
    try:
        import blockgen.lm_eval

        getattr(blockgen.lm_eval, WATCHED[name])(module)
    except Exception as err:
        _warn(f"hook into {name}", err)


class _AfterExec:
    """Loader wrapper: executes the module as the real loader would, then hands it to `_run`."""

    def __init__(self, loader, name: str, finder: "_Finder") -> None:
        self._loader = loader
        self._name = name
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run(self._name, module)
        if not self._finder.pending:  # all seen: stop looking at every import
            self._finder.uninstall()

    def __getattr__(self, attr: str):  # get_source, get_resource_reader, ... as the real loader
        return getattr(self._loader, attr)


class _Finder:
    """Meta-path finder that answers only for the modules in `WATCHED`, once each."""

    def __init__(self) -> None:
        self.pending = {name for name in WATCHED if name not in sys.modules}

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        try:
            for finder in sys.meta_path:  # the spec the import would have found without us
                find = getattr(finder, "find_spec", None)
                spec = None if finder is self or find is None else find(fullname, path, target)
                if spec is not None:
                    break
            if spec is None or not hasattr(spec.loader, "exec_module"):
                return None
            spec.loader = _AfterExec(spec.loader, fullname, self)
            return spec
        except Exception as err:
            _warn(f"watch {fullname}", err)
            return None

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Called by the .pth file at start-up: cheap (imports nothing), never raises."""
    try:
        if os.environ.get("BLOCKGEN_LM_EVAL_HOOK") == "0" or any(isinstance(f, _Finder) for f in sys.meta_path):
            return
        finder = _Finder()
        if finder.pending:
            sys.meta_path.insert(0, finder)
        for name in WATCHED:  # lm-eval already imported (installed from a running program)
            if name not in finder.pending:
                _run(name, sys.modules[name])
    except Exception as err:  # a start-up hook must never stop Python
        _warn("install its lm-eval start-up hook", err)
