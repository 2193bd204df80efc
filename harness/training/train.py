"""The training loop: one process, or torchrun / torch.distributed (gloo on CPU, NCCL on CUDA).

Per optimizer step the global batch is split into D = world_size x grad_accum micro-batch slots of
`micro_batch` sequences (grad_accum = batch_size / (world_size x micro_batch)).
Each slot gets one block size by the stratified selection of Algorithm 1 (the same draw on every
rank, from the step's seed) and its slice of stratified diffusion times. AdamW with linear warm-up,
gradient clipping, an EMA of the weights (used for validation and saved in model.safetensors),
periodic validation with the log-sum-exp bound, and crash-safe checkpoints a restarted run resumes
from (two slots, `checkpoint` and `checkpoint.prev`: harness/checkpoints/checkpoint.py; resuming, the copies
kept at `keep_steps` and the check that every rank sees one run directory: `run_directory`). SIGTERM,
SIGUSR1 or SIGINT stops the run at the next step boundary on every rank with a checkpoint (`stop_signals`).
Health: a NaN or infinite loss or gradient norm stops every rank before the step's update (`NonFiniteLoss`),
a loss far above its running average is flagged and reported (`LossSpikeMonitor`).
The settings are `train_config.TrainConfig`; the record of every step, `metrics_log`; a step's FLOPs and memory
estimate, `flops_memory`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from blockgen.harness.checkpoints.checkpoint import TRAINING_STATE, restore_latest_checkpoint, save_checkpoint
from blockgen.harness.data.sources import Examples
from blockgen.harness.runtime.distributed import (Distributed, leave_process_group, ranks_from_env, resolve_device,
                                                 setup_distributed)
from blockgen.harness.runtime.precision import enable_tf32  # one home for TF32 (evaluation uses it too)
from blockgen.harness.data.prepare import ensure_prepared, load_prepared
from blockgen.harness.runtime.progress import Progress
from blockgen.harness.checkpoints.tokenizer import special_tokens
from blockgen.harness.training.metrics_log import MetricsLog
from blockgen.harness.training.flops_memory import memory_estimate, names_the_knob, peak_flops, training_flops_per_step
from blockgen.harness.training.run_directory import (
    check_same_run_directory, checkpoint_step, hold_run_directory, keep_dir, resume_training_state,
)
from blockgen.harness.training.stop_signals import TrainingStopped, agreed_stop, stop_requests
from blockgen.harness.training.train_config import TrainConfig
from blockgen.models.attention import mark_masks_constant
from blockgen.models.model import BlockGen
from blockgen.models.objectives import stratified_indices, stratified_times


# ---------------------------------------------------------------------------------------------
# distributed plumbing


def all_reduce_sum(x: torch.Tensor, d: Distributed) -> torch.Tensor:
    if d.world_size > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


# ---------------------------------------------------------------------------------------------
# health: a non-finite loss stops the run, a loss spike is reported


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite: every rank stopped before applying its update,
    so the checkpoints on disk hold only weights from before it."""

    def __init__(self, step: int, loss: float, grad_norm: float, checkpoint: Path, saved_step: int) -> None:
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        where = f"the last checkpoint is {checkpoint} (step {saved_step})" if saved_step else "no checkpoint was written yet"
        # A resumed run may not change the settings, and it draws the same batches and noise: a new run must.
        super().__init__(f"step {step}: loss is {loss:g} (grad norm {grad_norm:g}); stopped before applying the step; "
                         f"{where}. Resuming would replay the same steps: train in a new --out-dir with a lower --lr or "
                         "a longer --warmup-steps (--init-from the checkpoint keeps its weights)")


def json_number(x: float) -> float | str:
    """`x`, or "nan" / "inf" / "-inf" where JSON has no number for it (`float()` reads either back)."""
    return x if math.isfinite(x) else str(x)


class LossSpikeMonitor:
    """Flags a step's loss far above the running average of the losses before it.

    The average is an exponential moving average with a time constant of `horizon` steps, normalised by
    its weights (so it is the plain mean at first, not biased towards zero). A loss is a spike when it
    is more than `ratio` times the average AND more than `margin` nats above it: the ratio alone would
    fire on a loss near 1e-4 jiggling to 3e-4, and the healthy demo curves jump by up to 0.3 nats per
    token at tiny losses (a hard batch for a model that has memorised the rest). The first `warmup`
    steps never count (the average has seen too few steps); they still enter the average.
    """

    def __init__(self, horizon: int = 50, ratio: float = 3.0, margin: float = 0.5, warmup: int = 10) -> None:
        self.decay, self.ratio, self.margin, self.warmup = 1 - 1 / horizon, ratio, margin, warmup
        self.total = self.weight = 0.0
        self.seen = 0

    @property
    def average(self) -> float | None:
        """The running average of the losses so far (None before the first)."""
        return self.total / self.weight if self.seen else None

    def update(self, loss: float) -> bool:
        """Whether `loss` is a spike against the average so far; then adds it to the average."""
        avg = self.average
        spike = avg is not None and self.seen >= self.warmup and loss > self.ratio * avg and loss - avg > self.margin
        self.total, self.weight, self.seen = self.decay * self.total + loss, self.decay * self.weight + 1, self.seen + 1
        return spike


# ---------------------------------------------------------------------------------------------
# training


class EMA:
    """Exponential moving average of the weights, with the usual warm-up (decay grows with steps)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(decay).add_(v.float(), alpha=1 - decay)
            else:
                self.shadow[k].copy_(v)

    def copy_to(self, model: torch.nn.Module) -> None:
        model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in self.shadow.items()})


@torch.no_grad()
def warm_start(model: BlockGen, checkpoint: str | Path, tokenizer) -> None:
    """Copy a checkpoint's weights into `model`. The priors may differ: the masked prior's extra
    [MASK] row of the embedding and output layer is the only shape difference allowed (the rows
    of the real vocabulary are copied, a row only one side has keeps its initialisation).
    A released checkpoint (hf:jdeschena/blockgen/<subfolder> or its folder) is imported first."""
    from safetensors.torch import load_file

    from blockgen.harness.checkpoints.checkpoint import WEIGHTS, CheckpointError, read_config
    from blockgen.harness.checkpoints.release_import import resolve_with_tokenizer

    if not str(checkpoint).startswith("hf:") and not Path(checkpoint).exists():
        raise CheckpointError(f"init_from={checkpoint}: does not exist")
    checkpoint = resolve_with_tokenizer(checkpoint, tokenizer)
    source = read_config(Path(checkpoint))
    if source.vocab_size != model.config.vocab_size or source.seq_len != model.config.seq_len:
        raise ValueError(f"init_from={checkpoint}: vocabulary {source.vocab_size} / seq_len {source.seq_len} "
                         f"differ from this run's {model.config.vocab_size} / {model.config.seq_len}")
    from transformers import PreTrainedTokenizerFast

    def real(vocab: dict) -> dict:  # ids past the real vocabulary (a release's added [PAD]) are no token of the model
        return {k: v for k, v in vocab.items() if v < source.vocab_size}

    if real(PreTrainedTokenizerFast.from_pretrained(str(checkpoint)).get_vocab()) != real(tokenizer.get_vocab()):
        raise ValueError(f"init_from={checkpoint} was trained with another tokenizer")
    weights = load_file(str(Path(checkpoint) / WEIGHTS))
    own = model.state_dict()
    if weights.keys() != own.keys():
        raise CheckpointError(f"init_from={checkpoint}: another architecture (parameters {sorted(weights.keys() ^ own.keys())[:5]})")
    vocab = model.config.vocab_size
    for name, target in own.items():
        value = weights[name]
        if value.shape == target.shape:
            target.copy_(value)
        elif value.shape[1:] == target.shape[1:] and {value.shape[0], target.shape[0]} == {vocab, vocab + 1}:
            target[:vocab].copy_(value[:vocab])
        else:
            raise CheckpointError(f"init_from={checkpoint}: {name} has shape {tuple(value.shape)}, this model {tuple(target.shape)}")


@torch.no_grad()
def validate(model: BlockGen, val: Examples, k_mc: int, batch_size: int, d: Distributed, seed: int) -> dict:
    """Token-level NLL (log-sum-exp and Jensen bounds) of the validation set; sharded over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    gen = torch.Generator(device=d.device).manual_seed(seed)
    shard = val[d.rank :: d.world_size]
    for i in range(0, len(shard), batch_size):
        b = shard[i : i + batch_size]
        x, lm, cm = (t.to(d.device) for t in (b.tokens, b.loss_mask, b.condition_mask))
        lse, jensen = model.nll_bounds(x, lm.float(), k_mc, cm, gen)
        totals += torch.stack([lse.sum().cpu(), jensen.sum().cpu(), lm.sum().double().cpu()])
    totals = all_reduce_sum(totals.to(d.device), d).cpu()
    model.train()
    lse, jensen, tokens = totals.tolist()
    return {"val_nll_lse": lse / tokens, "val_nll_jensen": jensen / tokens, "val_ppl_lse": math.exp(lse / tokens), "val_tokens": int(tokens)}


def slot_seed(seed: int, step: int, slot: int) -> int:
    """Seed of the random draws (noise, dropout) of one micro-batch slot of one optimizer step."""
    return (seed * 1_000_003 + step) * 65_537 + slot


def training_net(
    model: BlockGen, distributed: bool, compile: bool, backend: str = "inductor"
) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None]:
    """(what the training step calls, the DDP wrapper or None). Distributed: calls go through DDP's
    __call__, so that backward all-reduces gradients.

    `compile`: the model is compiled inside DDP, not DDP around it. Compiling the DDP wrapper makes
    dynamo trace DDP's own forward, which breaks the graph (its logger, `_inside_ddp_forward`: 3
    breaks per process on CPU gloo); inside it, dynamo still splits the graph at DDP's gradient
    buckets (DDPOptimizer finds the active DDP module). `backend`: "eager" in tests (dynamo's capture,
    no code generation).
    """
    # static shapes: block_size is a Python int, one graph per block size
    if compile:
        mark_masks_constant()
    if compile and next(model.parameters()).device.type == "cpu":
        from blockgen.models.backbone import fit_inductor_to_this_cpu

        fit_inductor_to_this_cpu()
    net = torch.compile(model, dynamic=False, backend=backend) if compile else model
    ddp = torch.nn.parallel.DistributedDataParallel(net) if distributed else None
    return (net if ddp is None else ddp), ddp


@functools.lru_cache(maxsize=1)
def _epoch_permutation(n_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of an epoch, from (seed, epoch) alone: a resumed run draws the uninterrupted run's.
    Cached: drawn once per epoch (a full randperm takes 0.35-0.6 s at TinyGSM/OWT sizes), never per step."""
    return torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def _slot_batches(n_examples: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """Global batch indices for a step: a fresh permutation per epoch (same on every rank)."""
    per_epoch = max(n_examples // batch, 1)
    epoch, offset = divmod(step, per_epoch)
    return _epoch_permutation(n_examples, seed, epoch)[offset * batch : (offset + 1) * batch]


def train(config: TrainConfig, progress: bool = True) -> Path:
    """Train (or resume) a model; returns the checkpoint directory."""
    # Settings that cannot run here fail now, before hours of data preparation and before out_dir exists.
    ranks = ranks_from_env()
    resolve_device(config.device, ranks)
    config.grad_accum(ranks.world_size)
    # The data cache first, before any process group: preparing it may take hours (`ensure_prepared`).
    prepared = ensure_prepared(config.data, config.seq_len)
    d = setup_distributed(config.device, config.dist_timeout_s)
    out = Path(config.out_dir)
    with hold_run_directory(out, d.is_main):  # a second run into `out` is refused, naming this one
        return _train(config, prepared, d, out, progress)


def _train(config: TrainConfig, prepared: Path, d: Distributed, out: Path, progress: bool) -> Path:
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    ckpt_dir = out / "checkpoint"
    # Every rank reads the prepared cache (memory-mapped) and the tokenizer saved with it: no hub access.
    tokenizer, train_data, val_data, data_info = load_prepared(prepared, config.data.n_val)
    special = special_tokens(tokenizer).to_dict()
    model_config = config.model_config(len(tokenizer), special, d.device)
    model = BlockGen(model_config).to(d.device)
    if d.is_main:  # the newest complete slot back at `checkpoint`, torn ones moved aside
        restore_latest_checkpoint(ckpt_dir)
    check_same_run_directory(out, ckpt_dir, d)  # (its barrier: every rank reads the restored slot)
    resuming = (ckpt_dir / TRAINING_STATE).is_file()
    if config.init_from is not None and not resuming:
        warm_start(model, config.init_from, tokenizer)
    ema = EMA(model, config.ema_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, config.adam_beta2), weight_decay=0.0)
    step = 0
    if resuming:
        step = resume_training_state(ckpt_dir, config, model, optimizer, ema, d.device)
        if d.is_main:
            print(f"resuming from step {step} of {ckpt_dir}", flush=True)
    net, ddp = training_net(model, d.world_size > 1, config.compile)

    grad_accum = config.grad_accum(d.world_size)
    slots = d.world_size * grad_accum
    micro = config.batch_size // slots
    bf16 = config.precision == "bf16" and d.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if d.device.type == "cuda":
        enable_tf32()
    if d.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{micro} sequences per process and micro-batch, {grad_accum} micro-batches per step; "
              + memory_estimate(model_config, n_params, micro, bf16, d.world_size).describe(), flush=True)
    flops_per_step = training_flops_per_step(model_config, config.batch_size)
    peak = peak_flops(str(d.device), config.peak_tflops)
    if d.is_main:
        (out / "train_config.json").write_text(json.dumps({**config.to_dict(), "data_info": data_info}, indent=2))
    metrics = MetricsLog(out, step, enabled=d.is_main)
    spikes = LossSpikeMonitor()
    for logged in metrics.losses():  # a resumed run (rank 0, which reports) picks its average up where it was
        spikes.update(logged)
    bar = Progress(out.name, total=config.max_steps, unit="steps", initial=step, enabled=progress and d.is_main,
                   every_steps=config.log_every, every_s=None)
    tokens_per_step = config.batch_size * config.seq_len  # the L tokens of each sequence, as bench/ counts them
    train_seconds, steps_timed, first_step = 0.0, 0, step + 1

    def ema_model() -> BlockGen:
        """A copy of the model holding the EMA weights (what validation and checkpoints use)."""
        copied = copy.deepcopy(model)
        ema.copy_to(copied)
        return copied

    def checkpoint(final: bool) -> None:
        if not d.is_main:
            return
        state = {
            "config": config.to_dict(),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "ema": ema.shadow,
            "step": step,
        }
        keep = keep_dir(out, step) if step in config.keep_steps else None
        save_checkpoint(ckpt_dir, ema_model(), tokenizer, state, extra={"step": step, "final": final, "data": data_info},
                        keep_previous=True, keep_copy=keep)

    def stop(err: Exception) -> NoReturn:
        """End the run on every rank with `err`, said by rank 0 before any rank leaves: torchrun stops the
        others when the first one exits."""
        bar.close()
        metrics.close()
        if d.is_main:
            print(f"blockgen train: {err}", file=sys.stderr, flush=True)
        if d.world_size > 1:
            dist.barrier()  # no rank leaves before rank 0 has saved, logged and said why
            leave_process_group()  # while every rank is past the barrier, not in the interpreter's teardown
        raise err

    model.train()
    with stop_requests() as signalled:
        while step < config.max_steps:
            step_start = time.perf_counter()
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
            u_block, u_time = torch.rand(2, generator=step_gen).tolist()
            block_idx = stratified_indices(model_config.block_weights, slots, u_block)
            block_sizes = [model_config.block_sizes[i] for i in block_idx]
            times = stratified_times(config.batch_size, u_time, model.schedule)
            batch_idx = _slot_batches(len(train_data), step, config.batch_size, config.seed)
            loss_sum = torch.zeros((), device=d.device)
            for a in range(grad_accum):
                slot = d.rank * grad_accum + a
                sl = slice(slot * micro, (slot + 1) * micro)
                b = train_data[batch_idx[sl]]
                x, lm, cm = (t.to(d.device) for t in (b.tokens, b.loss_mask, b.condition_mask))
                block_size = model_config.block_sizes[block_idx[slot]]
                sync = contextlib.nullcontext() if ddp is None or a == grad_accum - 1 else ddp.no_sync()
                # Noise and dropout of a micro-batch derive from (seed, step, slot) alone: a resumed run
                # draws what the uninterrupted run drew, on every rank, with no RNG state to save.
                torch.manual_seed(slot_seed(config.seed, step, slot))
                with sync, autocast, names_the_knob(micro, grad_accum):
                    total, count = net(x, lm.float(), block_size, times[sl].to(d.device), cm)
                    loss = total / count.clamp_min(1)
                    (loss / grad_accum).backward()
                loss_sum += loss.detach() / grad_accum
            # Both are the same on every rank (the loss all-reduced here, the gradients by DDP), so every
            # rank takes the same decision below and none waits in a collective for one that left.
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
            loss_val = all_reduce_sum(loss_sum, d).item() / d.world_size  # .item() waits for the device
            if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):  # before the update: the weights stay clean
                metrics.write({"step": step + 1, "loss": json_number(loss_val), "lr": lr, "grad_norm": json_number(grad_norm),
                               "block_sizes": block_sizes})
                stop(NonFiniteLoss(step + 1, loss_val, grad_norm, ckpt_dir, checkpoint_step(ckpt_dir)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model, step)
            step += 1
            seconds = time.perf_counter() - step_start
            if step > first_step:  # a process's first step includes start-up (and compilation)
                train_seconds, steps_timed = train_seconds + seconds, steps_timed + 1
            record = {
                "step": step, "loss": loss_val, "lr": lr, "grad_norm": grad_norm, "block_sizes": block_sizes,
                "step_seconds": seconds, "tokens_per_s": tokens_per_step / seconds,
                "mfu": None if peak is None else flops_per_step / seconds / (peak * d.world_size),
            }
            loss_avg = spikes.average
            if spikes.update(loss_val):
                record.update(loss_spike=True, loss_avg=loss_avg)
                if d.is_main:  # said also where the progress bar is off
                    spike = (f"step {step}: loss {loss_val:.4g} is {loss_val / loss_avg:.1f}x its running average "
                             f"{loss_avg:.4g} (loss spike; grad norm {grad_norm:.3g})")
                    bar.write(spike) if bar.enabled else print(spike, file=sys.stderr, flush=True)
            bar.update(1)
            if steps_timed:  # running means over the timed steps
                rate = tokens_per_step * steps_timed / train_seconds
                mfu = "" if peak is None else f"{flops_per_step * steps_timed / train_seconds / (peak * d.world_size):.1%}"
                bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{rate:.0f}", **({"mfu": mfu} if mfu else {}))
            if step % config.eval_every == 0 or step == config.max_steps:
                with names_the_knob(micro, grad_accum):
                    record.update(validate(ema_model(), val_data, config.k_mc, max(micro, 8), d, config.seed))
                if d.is_main:
                    bar.write(f"step {step}: val NLL/token {record['val_nll_lse']:.4f} (LSE) {record['val_nll_jensen']:.4f} (Jensen)")
            metrics.write(record)
            saved = step % config.save_every == 0 or step == config.max_steps or step in config.keep_steps
            if saved:
                checkpoint(final=step == config.max_steps)
            signum = agreed_stop(signalled[0], d)
            if signum and step < config.max_steps:
                if not saved:
                    checkpoint(final=False)
                stop(TrainingStopped(signum, step, ckpt_dir))
    bar.close()
    metrics.close()
    if d.world_size > 1:
        dist.barrier()
    return ckpt_dir
