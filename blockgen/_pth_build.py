"""Build-time only (named in pyproject.toml's [tool.setuptools.cmdclass]): ship the start-up hook's .pth.

A .pth file must sit at the top of site-packages, which no setuptools option can place. Regular
wheels take it from the root of build_lib (written by `build_py`); PEP 660 editable wheels are
assembled elsewhere, so `editable_wheel` writes it into the wheel next to setuptools' own
``__editable__`` .pth. The name sorts after ``__editable__.*.pth``, so in an editable install the
finder that maps ``blockgen`` to the source tree is in place when this line runs.
"""

from __future__ import annotations

from pathlib import Path

from setuptools.command.build_py import build_py as _build_py
from setuptools.command.editable_wheel import editable_wheel as _editable_wheel

PTH_NAME = "blockgen-lm-eval-hook.pth"
PTH_LINE = "import blockgen._lm_eval_hook; blockgen._lm_eval_hook.install()\n"


class build_py(_build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib, PTH_NAME)
            target.write_text(PTH_LINE)
            self.announce(f"writing {target}", level=2)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH_NAME))]


class editable_wheel(_editable_wheel):
    # setuptools has no public hook for extra top-level files in an editable wheel; wrapping the
    # strategy (which writes setuptools' own .pth the same way) is the narrowest place to add one.
    def _select_strategy(self, name, tag, build_lib):
        return _WithHookPth(super()._select_strategy(name, tag, build_lib))


class _WithHookPth:
    def __init__(self, strategy) -> None:
        self._strategy = strategy

    def __call__(self, wheel, files, mapping):
        result = self._strategy(wheel, files, mapping)
        wheel.writestr(PTH_NAME, PTH_LINE.encode())
        return result

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self._strategy.__exit__(*exc)
