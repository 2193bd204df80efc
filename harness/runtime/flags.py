"""A config field on the command line: its flag (`max_steps` is `--max-steps`, `data.n_val` is `--data.n-val`), and
the check the configs share for their counts. Imports nothing: the command line uses it before any subcommand is mounted."""

from __future__ import annotations


def flag(field: str) -> str:
    """The option of a config field, as `blockgen`'s parsers generate it (harness/cli.py)."""
    return "--" + field.replace("_", "-")


def require_whole_numbers(config: object, *fields: str) -> None:
    """Raise ValueError, naming the flag, for the first of `config`'s `fields` below 1 (None: not set). Steps between
    saves, Monte Carlo draws, batch sizes: a 0 divides by zero mid-run or runs nothing."""
    for field in fields:
        value = getattr(config, field)
        if value is not None and value < 1:
            raise ValueError(f"{field}={value} ({flag(field)}); choose a whole number >= 1")
