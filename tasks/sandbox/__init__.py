"""Sandbox: runs model-written Python (the gsm8k_code task's programs), each in a fresh bubblewrap
of its own: new namespaces over a minimal read-only root (`isolation`), a seccomp filter
(`seccomp`), per-run budgets of cgroups and rlimits (`cgroups`) and a trusted pid 1 inside
(`child`, run by its text, never imported); `runner` drives the runs from the evaluator's side,
`results` reads how each ended, `config` holds the limits. Here: the public API (docs/sandbox.md).
"""

from .config import ENTRY_POINT, MAX_CONCURRENT, MAX_INT_BITS, NOBODY, UID_BASE, KiB, MiB, SandboxConfig
from .results import Outcome, SandboxResult
from .runner import isolation_report, run_many, run_program

__all__ = [
    "ENTRY_POINT", "MAX_CONCURRENT", "MAX_INT_BITS", "NOBODY", "UID_BASE", "KiB", "MiB",
    "Outcome", "SandboxConfig", "SandboxResult", "isolation_report", "run_many", "run_program",
]
