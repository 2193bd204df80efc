"""Calls to the Hugging Face hub, failing loudly (never silently falling back) when it is unreachable."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

OFFLINE_HINT = (
    "The Hugging Face hub is unreachable from this machine (or the name is wrong). "
    "Use a local path, or the embedded offline default: `make demo` "
    "(procedurally generated word problems, a locally trained tokenizer, tiny models)."
)


class HubUnavailableError(RuntimeError):
    pass


def hub_call(load: Callable[[], T], what: str) -> T:
    """Run a loader that may touch the hub; turn network/lookup failures into one clear error."""
    try:
        return load()
    except (OSError, ConnectionError, TimeoutError, ValueError) as err:
        # transformers/datasets raise OSError (or subclasses) for "not found locally and offline".
        raise HubUnavailableError(f"could not load {what}: {err}\n{OFFLINE_HINT}") from err
