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


def check_reachable(datasets: list[str], models: list[str], timeout: float = 10.0) -> None:
    """Raise HubUnavailableError unless every dataset and model repository answers (or is cached offline)."""
    import os

    from huggingface_hub import HfApi

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise HubUnavailableError("HF_HUB_OFFLINE is set")
    api = HfApi()
    for kind, names, info in (("dataset", datasets, api.dataset_info), ("model", models, api.model_info)):
        for name in names:
            try:
                info(name, timeout=timeout)
            except Exception as err:  # network errors, DNS, 404: all mean "cannot use it from here"
                raise HubUnavailableError(f"{kind} {name} is not reachable on the Hugging Face hub ({type(err).__name__})") from err
