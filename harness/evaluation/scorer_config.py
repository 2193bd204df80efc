"""What the scorers of generative perplexity share: their settings (`ScorerConfig`), their error
(`ScorerError`), and the count of what this process started (`STARTS`).

Its own module so that the scorer API (`scorers`) and the vLLM server it starts (`vllm_server`) both
import it without importing each other.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, fields
from typing import Any, Literal

BACKENDS = ("transformers", "vllm")

# What this process started: `blockgen sweep` reports it (one server and one in-process model per sweep).
STARTS: collections.Counter = collections.Counter()


class ScorerError(RuntimeError):
    """A scorer could not start or stopped answering; the message says why and what to do."""


@dataclass(frozen=True)
class ScorerConfig:
    backend: Literal["transformers", "vllm"] = "transformers"
    model: str = "gpt2-large"  # a Hugging Face directory (model and tokenizer) or a hub name
    url: str | None = None  # vllm: an OpenAI-compatible server already serving `model`
    port: int = 0  # vllm: loopback port of the server the harness starts (0: a free one)
    device: str = "auto"  # transformers: auto (cuda if available, else cpu), cpu, cuda:N
    dtype: str = "float32"  # the transformers scorer (and MAUVE's features)
    vllm_dtype: str = "auto"  # vllm: auto = float32 on a CPU build, float16 on a CUDA build (see vllm_server's doc)
    batch_size: int = 8  # sequences per forward pass (transformers) or per HTTP request (vllm)
    vllm_python: str | None = None  # interpreter of the vLLM environment (see `vllm_server.vllm_python`)
    vllm_args: str = ""  # extra `vllm serve` options, e.g. "--gpu-memory-utilization 0.5"
    start_timeout: float = 900.0  # seconds to wait for the server's /health

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown scorer backend {self.backend!r}; choose one of {list(BACKENDS)}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"scorer batch_size={self.batch_size!r}; must be an integer >= 1")

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> "ScorerConfig":
        """From lm-eval task metadata: `scorer` is the backend, `scorer_<field>` any other field.

        Task YAMLs give defaults; `lm_eval --metadata '{"scorer": "vllm", "scorer_model": DIR}'`
        overrides them. An unknown `scorer_*` key is an error that lists the valid ones.
        """
        names = {f.name for f in fields(cls)} - {"backend"}
        given = {k[len("scorer_"):]: v for k, v in metadata.items() if k.startswith("scorer_")}
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"unknown scorer setting(s) {['scorer_' + k for k in unknown]}; "
                             f"valid: {['scorer'] + sorted('scorer_' + n for n in names)}")
        if "scorer" in metadata:
            given["backend"] = metadata["scorer"]
        return cls(**{k: v for k, v in given.items() if v is not None})
