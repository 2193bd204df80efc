"""lm-evaluation-harness model type ``blockgen``: the only module that knows lm-eval's request types.

    lm_eval --model blockgen --model_args pretrained=DIR,k_mc=8,sampler=arpc,steps=8 --tasks ...

- ``loglikelihood`` / ``loglikelihood_rolling``: the log-sum-exp bound over the checkpoint's block
  sizes (paper appendix C), per scored window: the window's prefix stays clean in the noisy stream
  (``condition_mask``), positions start at 0 and blocks sit at multiples of L' as in training (the
  last block may be partial), and only the scored tokens carry loss. Windows of one batch are padded
  to a common length, and the padding is invisible to every real token (`DiT.forward_train`'s
  ``valid``), so a score depends on the request's tokens only. A window is at most ``seq_len``
  tokens; longer inputs are left-truncated (loglikelihood, with a warning) or cut into lm-eval's
  disjoint rolling windows (each token scored once). ``is_greedy`` comes from the AR pass (block
  size 1); without block size 1 in the mixture it is always False.
- ``generate_until``: any sampler of `blockgen.models.sampling`, chosen by model arguments and
  overridable per task through ``gen_kwargs``; requests are batched (``gen_batch_size``, else
  ``--batch_size``) with lm-eval's `Collator`, grouped by task and sampler settings except the
  generation budget (``max_gen_toks``), longest prompt first: rows of one batch keep their own
  budgets (gsm8k_code gives each its own), so one setting makes full batches.

Reproducibility: every scored window and every generation request draws from its own generator,
seeded from the run's seed and the request, so a result does not depend on the batch it ran in nor
on how torchrun split the work. Log-likelihood windows are seeded by their context only and draw at
fixed positions (`diffusion.RowStreams`: draw p of a call is keyed by p): the choices of one multiple-choice question see the
same times and the same noise at the same positions (common random numbers), so the differences
between choices are not drowned by draw-to-draw noise.

Monte Carlo error: each log-likelihood's standard error is estimated from its K_MC draws by the
delta method (`mc_variance`); the results JSON reports it per request and its effect on which
choice wins (``config.blockgen.tasks``, see `Usage`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections import Counter, defaultdict
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import torch
from tqdm import tqdm

import lm_eval.models  # noqa: F401  lm-eval's own models first: get_model adds them only to an empty registry
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator

from blockgen.harness.checkpoints.checkpoint import checkpoint_hash, checkpoint_special_tokens, load_checkpoint, read_config
from blockgen.harness.evaluation.lm_eval_model.arguments import (
    BlockGenLMArgs,
    check_checkpoint_dir,
    default_sampler,
    gen_kwargs_sampler,
    requested_device,
    warn_once,
)
from blockgen.harness.evaluation.lm_eval_model.mc_error import RequestScore
from blockgen.harness.evaluation.lm_eval_model.scoring import Window, WindowScore, derive_seed, score_windows, windows
from blockgen.harness.evaluation.lm_eval_model.usage import CACHED_REQUEST_TYPES, Usage, load_stored_usage
from blockgen.harness.runtime.distributed import setup_distributed
from blockgen.harness.runtime.precision import DTYPES, compute_precision
from blockgen.models import samplers
from blockgen.models.model import BlockGenConfig
from blockgen.models.sampler_config import SamplerConfig, paper_nfe_per_block
from blockgen.models.sampling import generate, max_prompt_len, resolve_block_size

log = logging.getLogger(__name__)

# `--batch_size auto` on a CPU: the model is small enough that memory is never the limit; 16 rows
# already amortise the per-call overhead of the micro and tiny models (bench/bench_generate.py).
AUTO_BATCH_SIZE_CPU = 16


class _Plan(NamedTuple):
    """One generation request, resolved: prompt ids, sampler, stop strings, seed and bookkeeping."""

    prompt: list[int]
    sampler: SamplerConfig
    until: list[str]
    seed: int
    task: str
    dropped: int  # prompt tokens cut from the left to fit
    ignore_eos: bool = False  # the whole budget, EOS kept in the text as a token


@register_model("blockgen")
class BlockGenLM(TemplateLM):
    """A BlockGen checkpoint behind lm-eval's LM interface (see the module docstring)."""

    # Seed a log-likelihood window by its context only (common random numbers across the choices of
    # one context). False seeds it by the whole window: bench/bench_mc_noise.py measures both.
    common_random_numbers = True
    # --use_cache: lm-eval's cache file (`set_cache_hook`, until `_settle_cache`) and the run's tasks (`check_tasks`)
    _cache_file: str | None = None
    _cache_tasks: dict | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        args = BlockGenLMArgs.parse(kwargs)
        if args.seed is None:  # lm-eval seeded torch from --seed before building the model
            args = replace(args, seed=torch.initial_seed())
        self.args = args
        # A release is converted once into a checkpoint directory (cached); its source is reported.
        from blockgen.harness.checkpoints.release_import import release_source, resolve
        from blockgen.harness.checkpoints.release_paths import ReleaseOverrides

        overrides = ReleaseOverrides.from_model_args(args.algo, args.prior, args.block_sizes, args.block_weights,
                                                     args.x0_causal, args.tokenizer)
        self.checkpoint_dir = str(resolve(args.pretrained, overrides))
        self.source = release_source(self.checkpoint_dir)
        # Everything checkable from config.json is checked before any weights load or ranks connect.
        check_checkpoint_dir(self.checkpoint_dir)
        config = read_config(self.checkpoint_dir)
        self.sampler = default_sampler(args, config)
        self._gen_settings_cache: dict[str, tuple[SamplerConfig, list[str]]] = {}
        self._fewshot: dict[str, int] = {}  # task -> num_fewshot, from `check_tasks`
        self.usage = Usage()
        self._usage_by_rank: list[Usage] | None = None

        ranks = setup_distributed(requested_device(args.device))  # joins torchrun's group when there is one
        self._device, self._world_size, self._rank = ranks.device, ranks.world_size, ranks.rank
        self.model, self.tokenizer = load_checkpoint(self.checkpoint_dir, self._device)
        self.special = checkpoint_special_tokens(self.model, self.tokenizer)
        self.checkpoint_hash = checkpoint_hash(self.checkpoint_dir)
        self._batch_size = self._auto_batch_size() if args.batch_size == "auto" else args.batch_size
        if args.batch_size == "auto":  # lm-eval records these in the results' config.batch_sizes
            self.batch_sizes = {0: self._batch_size}
        if 1 not in config.block_sizes:
            log.warning("blockgen: block sizes %s have no AR component (1): loglikelihood's is_greedy is always False",
                        list(config.block_sizes))

    # Model arguments that pick the weights; `with_settings` keeps them.
    LOADED_ARGS = ("pretrained", "tokenizer", "algo", "prior", "block_sizes", "block_weights", "x0_causal")

    def with_settings(self, **model_args: Any) -> "BlockGenLM":
        """This model as if built with other `--model_args` (sampler, steps, k_mc, ...), sharing the
        loaded weights: `blockgen sweep` evaluates many settings on one load. Arguments that pick the
        weights must equal the loaded ones; the seed, batch size and device stay."""
        changed = sorted(k for k in self.LOADED_ARGS if k in model_args and model_args[k] != getattr(self.args, k))
        if changed:
            raise ValueError(f"with_settings cannot change {changed}: they pick the loaded weights; build a new model")
        kept = {k: getattr(self.args, k) for k in (*self.LOADED_ARGS, "seed", "batch_size", "gen_batch_size", "device",
                                                    "max_batch_size")}
        args = BlockGenLMArgs.parse({**kept, **model_args})
        other = copy.copy(self)  # shallow: the model, tokenizer and process group are shared
        other.args = args
        other.sampler = default_sampler(args, self.config)
        other._gen_settings_cache, other._fewshot = {}, {}
        other.usage, other._usage_by_rank = Usage(), None
        return other

    def _auto_batch_size(self) -> int:
        """`--batch_size auto`: on a CPU `AUTO_BATCH_SIZE_CPU`; on a GPU the largest power of two up to
        `max_batch_size` (default 64) whose heaviest call, a full-length scored window at the largest
        block size, fits in memory."""
        limit = self.args.max_batch_size or 64
        if self._device.type != "cuda":
            size = min(AUTO_BATCH_SIZE_CPU, limit)
        else:
            size = 1 << (limit.bit_length() - 1)
            window = Window(tuple([self.special.bos] * self.max_length), 1)
            while size > 1:
                try:
                    with self._precision():
                        score_windows(self.model, [window] * size, list(range(size)), 1, self.special.pad)
                    break
                except torch.cuda.OutOfMemoryError:
                    size //= 2
                finally:
                    torch.cuda.empty_cache()
        log.info("blockgen: --batch_size auto -> %d", size)
        return size

    @property
    def batch_invariant(self) -> dict[str, bool]:
        """Per kind of request, whether its batches run in the network's row-invariant mode: the `batch_invariant`
        model argument; unset, on a CPU, log-likelihoods and the diffusion samplers' texts (at most 1.3x the fastest
        path there), not autoregressive decoding's (above it), and nothing on CUDA (not measured): bench/README.md,
        "Batch invariance"."""
        chosen = self.args.batch_invariant
        if chosen is not None:
            return dict.fromkeys(("likelihood", "generation", "autoregressive_generation"), chosen)
        cpu = self._device.type != "cuda"
        return {"likelihood": cpu, "generation": cpu, "autoregressive_generation": False}

    def _invariant_generation(self, sampler: SamplerConfig) -> bool:
        return self.batch_invariant["autoregressive_generation" if samplers.get(sampler.name).autoregressive else "generation"]

    def _precision(self):
        """The context of every model call: the `dtype` and `tf32` model arguments (harness/runtime/precision.py)."""
        return compute_precision(self._device, self.args.dtype, self.args.tf32)

    # -------------------------------------------------------------- lm-eval's interface: basics

    @property
    def config(self) -> BlockGenConfig:
        return self.model.config

    @property
    def eot_token_id(self) -> int:
        return self.special.eos

    @property
    def prefix_token_id(self) -> int:
        return self.special.bos

    @property
    def max_length(self) -> int:
        return self.config.seq_len

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def gen_batch_size(self) -> int:
        """Rows per generate_until batch: the gen_batch_size model argument, else the batch size."""
        return self.args.gen_batch_size or self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        """Checkpoint and every setting that changes an answer (not batch size or device)."""
        a = self.args
        # precision only when it is not the default, so that float32 runs keep their fingerprint (and --use_cache table)
        precision = [(a.dtype, a.tf32)] if (DTYPES[a.dtype], a.tf32) != (torch.float32, False) else []
        return derive_seed(self.checkpoint_hash, a.k_mc, a.seed, a.add_bos, self.sampler.as_dict(), *precision).to_bytes(8, "little").hex()

    @property
    def tokenizer_name(self) -> str:
        return f"blockgen-{self.fingerprint}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"blockgen: --apply_chat_template, but the checkpoint {self.args.pretrained} has no chat template "
                "(BlockGen models are trained on plain text); run without --apply_chat_template")
        return super().chat_template(chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def set_cache_hook(self, cache_hook) -> None:
        # lm-eval's --use_cache (CachingLM) keys answers by request arguments only and hands its
        # SqliteDict over here. Reopening that dict on a table named after our fingerprint keeps
        # other checkpoints' and settings' answers (same file, other tables) out of reach.
        db = getattr(cache_hook, "dbdict", None)
        if db is not None and db.tablename != self.tokenizer_name:
            autocommit = db.autocommit
            db.close()
            db.__init__(db.filename, tablename=self.tokenizer_name, autocommit=autocommit)
        if db is not None:
            self._cache_file = db.filename
        super().set_cache_hook(cache_hook)

    def _settle_cache(self) -> None:
        """Once, after the requests ran: the usage of answers lm-eval's --use_cache gave without the model.

        A task whose requests all reached the model stores its `Usage` beside the answers (table
        ``usage-<fingerprint>``, keyed by the task and lm-eval's keys of its requests); a task answered
        wholly from the cache reports the usage so stored, so that its leaderboard rows (block size,
        calls, tokens/s) are those of the run that computed the answers. Either way the report counts
        the requests answered from the cache (`Usage.cached`).
        """
        path, self._cache_file = self._cache_file, None
        if path is None or not self._cache_tasks:
            return
        from lm_eval.api.model import hash_args
        from sqlitedict import SqliteDict

        with SqliteDict(path, tablename=f"usage-{self.tokenizer_name}", autocommit=True, decode=load_stored_usage) as db:
            for name, task in self._cache_tasks.items():
                cacheable = [i for i in task.instances or [] if i.request_type in CACHED_REQUEST_TYPES]
                if not cacheable:  # e.g. owt_ppl's loglikelihood_windows, never cached
                    continue
                key = hash_args(name, sorted(hash_args(i.request_type, i.args) for i in cacheable))
                asked: Counter = Counter()
                for i in cacheable:
                    asked[i.request_type] += i.repeats
                # the requests that reached the model (torchrun's padding copies can make it more)
                ran = {kind: self.usage.counts.get((name, kind), Counter())["requests"] for kind in asked}
                cached = {(name, kind): n - ran[kind] for kind, n in asked.items() if n > ran[kind]}
                if not cached:
                    db[key] = self.usage.only(name)
                    continue
                if not any(ran.values()) and key in db:
                    self.usage = Usage.merge([self.usage, db[key]])
                    self.usage.stored.add(name)
                self.usage.cached.update(cached)

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.config
        self._settle_cache()
        usage = Usage.merge(self._usage_by_rank) if self._usage_by_rank else self.usage
        return {
            # a released model is named by its source (hf:jdeschena/blockgen/<subfolder>), not the cache
            "model_checkpoint": self.source or os.path.abspath(self.checkpoint_dir),
            "model_source": self.source,
            "model_sha": self.checkpoint_hash,
            "model_num_parameters": self.model.dit.n_params(),
            "blockgen": {
                "prior": cfg.prior,
                "block_sizes": list(cfg.block_sizes),
                "block_weights": list(cfg.block_weights),
                "seq_len": cfg.seq_len,
                "k_mc": self.args.k_mc,
                "seed": self.args.seed,
                "add_bos": self.args.add_bos,
                "dtype": self.args.dtype,
                "tf32": self.args.tf32,
                "batch_invariant": self.batch_invariant,
                # block size as used (None asks for the largest): rows of tasks without usage still name it.
                # What ran, once: the seed is `seed` above (every request's draws derive from it), and the
                # tokens per request are each task's max_gen_toks (`tasks.<task>.generate_until.settings`), so
                # the setting's own defaults of both are left out.
                "sampler": {**{k: v for k, v in self.sampler.as_dict().items() if k not in ("seed", "max_new_tokens")},
                            "block_size": resolve_block_size(cfg, self.sampler),
                            "paper_nfe_per_block": paper_nfe_per_block(self.sampler)},
                "nfe": self.args.nfe,  # as asked (None: steps/ge/warmup given directly)
                "batch_size": self._batch_size,  # the size used, also when --batch_size auto chose it
                "gen_batch_size": self.gen_batch_size,  # rows per generation batch used (gen_batch_size, else batch_size)
                "fingerprint": self.fingerprint,
                "tasks": usage.report(),
            },
        }

    # -------------------------------------------------------------- checks before any request

    def check_tasks(self, task_dict: dict) -> None:
        """Validate every generate_until task's gen_kwargs before any request runs (called by the
        `lm_eval.evaluator.evaluate` wrapper that `blockgen.lm_eval` installs)."""
        from lm_eval.evaluator_utils import _handle_back_comp

        tasks = task_dict["tasks"] if "tasks" in task_dict else _handle_back_comp(task_dict)[1]
        self._cache_tasks = tasks  # their requests, once built, are what --use_cache answered (`_settle_cache`)
        for name, task in tasks.items():
            config = getattr(task, "config", None)
            if config is None:
                continue
            self._fewshot[name] = int(getattr(config, "num_fewshot", 0) or 0)
            if getattr(task, "OUTPUT_TYPE", None) == "generate_until":
                self._settings(config.generation_kwargs, name)

    # -------------------------------------------------------------- likelihoods

    def _with_bos(self, context: list[int]) -> list[int]:
        if self.args.add_bos and context[:1] != [self.special.bos]:
            return [self.special.bos, *context]
        return context

    def _score(self, items: list[Window], seeds: list[int], what: str, disable_tqdm: bool) -> list[WindowScore]:
        """Score windows in batches of batch_size, longest first (lm-eval's Collator)."""
        collator = Collator(list(zip(items, seeds)), sort_fn=lambda item: (-len(item[0].tokens), item[0].tokens))
        out: list[WindowScore] = []
        bar = tqdm(total=len(items), desc=f"blockgen {what}", disable=disable_tqdm or self.rank != 0)
        for batch in collator.get_batched(n=self.batch_size):
            ws, ss = zip(*batch)
            with self._precision():
                out.extend(score_windows(self.model, list(ws), list(ss), self.args.k_mc, self.special.pad,
                                         self.batch_invariant["likelihood"]))
            bar.update(len(batch))
        bar.close()
        return collator.get_original(out)

    def _encode_pair_or_prefix(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's TemplateLM tokenisation: an empty context becomes the prefix (BOS) token."""
        if context == "":
            cont = self.tok_encode(continuation)
            return ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])
        return self._encode_pair(context, continuation)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        tokenized = [((req.args[0], req.args[1]), *self._encode_pair_or_prefix(*req.args)) for req in requests]
        return self._loglikelihood_tokens(tokenized, disable_tqdm, owners=[_owner(req) for req in requests])

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, owners=None, **kwargs) -> list[tuple[float, bool]]:
        owners = owners or [_owner(None)] * len(requests)
        items, seeds, which, dropped = [], [], [], []
        for i, (_, context, continuation) in enumerate(requests):
            context = self._with_bos(list(context))
            ws = windows(context, list(continuation), self.max_length)
            kept = len(ws[0].tokens) - len(continuation) if len(ws) == 1 else 1  # rolling windows keep 1 context token
            dropped.append(len(context) - kept if ws else 0)
            for w in ws:
                # Seeded by the window's context only: the choices of one context share their draws.
                seeded_by = w.tokens[: w.n_context] if self.common_random_numbers else w
                seeds.append(derive_seed(self.args.seed, "loglikelihood", list(seeded_by)))
                items.append(w)
                which.append(i)
        scores = self._score(items, seeds, "loglikelihood", disable_tqdm)
        results = self._collect(requests, which, scores)
        self._record_likelihood("loglikelihood", owners, results, dropped)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, (result.logp, result.greedy))
        return [(r.logp, r.greedy) for r in results]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        items, seeds, which = [], [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for w in windows([self.prefix_token_id], self.tok_encode(text), self.max_length):
                seeds.append(derive_seed(self.args.seed, "loglikelihood_rolling", list(w.tokens), w.n_context))
                items.append(w)
                which.append(i)
        scores = self._score(items, seeds, "loglikelihood_rolling", disable_tqdm)
        results = self._collect(requests, which, scores)
        self._record_likelihood("loglikelihood_rolling", [_owner(r) for r in requests], results, [0] * len(requests))
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result.logp)
        return [r.logp for r in results]

    def loglikelihood_windows(self, requests, disable_tqdm: bool = False) -> list[tuple[float, float]]:
        """Exact token windows (tasks/owt.py's ``owt_ppl``): request args (text, token ids), the ids
        scored whole from position 0 as training validates a chunk; returns (-LSE, -Jensen) bounds."""
        items = [Window(tuple(req.args[1]), 0) for req in requests]
        if any(len(w.tokens) > self.max_length for w in items):
            raise ValueError(f"blockgen loglikelihood_windows: a window is longer than seq_len={self.max_length}")
        seeds = [derive_seed(self.args.seed, "loglikelihood_windows", list(w.tokens)) for w in items]
        scores = self._score(items, seeds, "loglikelihood_windows", disable_tqdm)
        return [(-s.lse, -s.jensen) for s in scores]

    @staticmethod
    def _collect(requests, which: list[int], scores: list[WindowScore]) -> list[RequestScore]:
        per_request: list[list[WindowScore]] = [[] for _ in requests]
        for i, s in zip(which, scores):
            per_request[i].append(s)
        return [RequestScore(-sum(s.lse for s in ss), all(s.greedy for s in ss), tuple(ss)) for ss in per_request]

    def _record_likelihood(self, kind: str, owners, results: list[RequestScore], dropped: list[int]) -> None:
        docs: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        for (task, doc, idx), result, cut in zip(owners, results, dropped):
            self.usage.request(task, kind, cut)
            docs[task][doc].append((idx, result))
        for task, by_doc in docs.items():
            for doc, scores in by_doc.items():
                self.usage.scored(task, kind, doc, scores, self.args.k_mc)
        self._warn_truncation(kind, owners, dropped, f"contexts were cut from the left to fit seq_len={self.max_length}")

    def _warn_truncation(self, kind: str, owners, dropped: list[int], what: str) -> None:
        """Truncation is never silent (as lm-eval's hf backend): per task, how many requests and tokens."""
        per_task: dict[str, list[int]] = defaultdict(list)
        for (task, _, _), cut in zip(owners, dropped):
            if cut:
                per_task[task].append(cut)
        for task, cuts in per_task.items():
            hint = ""
            if self._fewshot.get(task):
                hint = f"; the prompts carry --num_fewshot {self._fewshot[task]} examples: lower --num_fewshot"
            log.warning("blockgen %s, task %s: %d of %d requests' %s (%d tokens dropped in all, up to %d in one)%s",
                        kind, task, len(cuts), sum(1 for o in owners if o[0] == task), what, sum(cuts), max(cuts), hint)

    # -------------------------------------------------------------- generation

    def _settings(self, gen_kwargs: dict | None, task: str) -> tuple[SamplerConfig, list[str]]:
        """(sampler, stop strings) of a task's gen_kwargs; raises, naming the task, on a bad one."""
        key = json.dumps(gen_kwargs or {}, sort_keys=True, default=str)
        if key not in self._gen_settings_cache:
            try:
                self._gen_settings_cache[key] = gen_kwargs_sampler(self.sampler, self.config, self.args.steps is not None,
                                                                     dict(gen_kwargs or {}), nfe=self.args.nfe)
            except ValueError as err:
                raise ValueError(f"blockgen, task {task}: gen_kwargs {gen_kwargs}: {err}") from None
        return self._gen_settings_cache[key]

    def _plan(self, req, repeat: int) -> _Plan:
        """`repeat`: how many identical requests of the same document came before this one (lm-eval's
        `repeats`, e.g. maj@k), so each repeat draws its own sample. The document id is global (the
        same on every torchrun rank), so documents with identical prompts (unconditional samples)
        draw different samples however the documents are split over ranks."""
        context, gen_kwargs = req.args
        task, doc_id, _ = _owner(req)
        sampler, until = self._settings(gen_kwargs, task)
        prompt = self._with_bos(self.tok_encode(context)) or [self.special.bos]
        room = max_prompt_len(self.config, sampler)
        dropped = max(0, len(prompt) - room)
        prompt = prompt[dropped:]
        seed = derive_seed(self.args.seed, "generate_until", prompt, sampler.as_dict(), doc_id, repeat)
        ignore_eos = (gen_kwargs or {}).get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"blockgen, task {task}: gen_kwargs ignore_eos={ignore_eos!r}; must be true or false")
        return _Plan(prompt, sampler, until, seed, task, dropped, ignore_eos)

    def _decode(self, ids: list[int], keep_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not keep_special)

    def _stop(self, until: list[str]) -> Callable[[list[int]], bool] | None:
        if not until:
            return None
        return lambda ids: any(s in self._decode(ids) for s in until)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        seen: Counter = Counter()
        plans = []
        for req in requests:  # every gen_kwargs is checked before any generation
            task, doc_id, _ = _owner(req)
            key = json.dumps([task, doc_id, req.args], sort_keys=True, default=str)
            plans.append(self._plan(req, seen[key]))
            seen[key] += 1
        for plan in plans:
            self.usage.request(plan.task, "generate_until", plan.dropped)
        self._warn_truncation("generate_until", [_owner(r) for r in requests], [p.dropped for p in plans],
                              "prompts were cut from the left to leave room for max_gen_toks")
        # One batch: one task and one sampler setting up to the budget, longest prompt first (lm-eval's
        # Collator). Each row keeps its own budget (and its seed, derived from its own settings).
        collator = Collator(list(zip(requests, plans)), sort_fn=lambda item: (-len(item[1].prompt), item[1].prompt),
                            group_fn=lambda item: _batch_key(item[1]), group_by="gen_kwargs")
        out: list[str] = []
        bar = tqdm(total=len(requests), desc="blockgen generate_until", disable=disable_tqdm or self.rank != 0)
        if self.args.compile and self._device.type == "cpu":
            warn_once("compile=true on the CPU: the first batch compiles each kind of model call with inductor, minutes "
                      "in which nothing is printed; it pays only over many calls")
        for batch in collator.get_batched(n=self.gen_batch_size):
            batch_plans = [plan for _, plan in batch]
            budgets = [p.sampler.max_new_tokens for p in batch_plans]
            sampler = replace(batch_plans[0].sampler, max_new_tokens=max(budgets))
            start = time.perf_counter()
            with self._precision():
                eos = -1 if batch_plans[0].ignore_eos else self.special.eos  # -1: no token stops a row
                result = generate(self.model, [p.prompt for p in batch_plans], sampler, eos, self.special.pad,
                                  stop=[self._stop(p.until) for p in batch_plans], seeds=[p.seed for p in batch_plans],
                                  max_new_tokens=budgets, batch_invariant=self._invariant_generation(sampler),
                                  compile=self.args.compile)
            self.usage.generated(batch_plans[0].task, settings_record(self.config, sampler), result, len(batch),
                                 time.perf_counter() - start)
            for (req, plan), ids in zip(batch, result.tokens):
                text = self._decode(ids, keep_special=plan.ignore_eos)
                for s in plan.until:  # the sampler stops after a block; cut at the first stop string
                    text = text.split(s)[0]
                self.cache_hook.add_partial("generate_until", req.args, text)
                out.append(text)
            bar.update(len(batch))
        bar.close()
        return collator.get_original(out)

    # -------------------------------------------------------------- data parallel (torchrun)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """lm-eval gathers samples and metrics to rank 0 after all requests ran, on every rank; our
        per-rank `Usage` rides along, so rank 0's results JSON reports the whole run."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        self._settle_cache()  # each rank has its own cache file
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object((obj, self.usage), gathered, dst=dst)
        if gathered is None:
            return None
        self._usage_by_rank = [usage for _, usage in gathered]
        return [o for o, _ in gathered]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def _owner(req) -> tuple[str, Any, int]:
    """(task name, doc id, index within the doc) of a request; direct calls without a task use '-'."""
    if req is None:
        return "-", None, 0
    return req.task_name or "-", req.doc_id, req.idx


def _batch_key(plan: _Plan) -> dict:
    """What the rows of one generation batch share: the task, whether EOS stops a row, and the sampler
    settings but the budget."""
    return {"task": plan.task, "ignore_eos": plan.ignore_eos, **{k: v for k, v in plan.sampler.as_dict().items() if k != "max_new_tokens"}}


def settings_record(config: BlockGenConfig, sampler: SamplerConfig) -> dict:
    """The settings a batch really ran with, as the results JSON reports them (``max_gen_toks``: the
    batch's largest budget; `Usage` reports the largest of a setting's rows)."""
    return {"sampler": sampler.name, "steps": sampler.steps, "ge": sampler.ge, "warmup": sampler.warmup,
            "temperature": sampler.temperature, "block_size": resolve_block_size(config, sampler),
            "layout": sampler.layout, "max_gen_toks": sampler.max_new_tokens,
            "paper_nfe_per_block": paper_nfe_per_block(sampler), **dict(sampler.options)}
