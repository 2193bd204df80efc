"""Training throughput of the tiny model: a BlockGen step vs an AR step, measured side by side.

A BlockGen step runs `[x0 ; xt]` (2L tokens) under the block-diffusion mask; an AR step of the same
model runs block size 1 (the same 2L layout: that is how BlockGen trains its AR component) and, as
the reference a user would compare with, a plain causal transformer pass over L tokens with the same
weights. Steps are interleaved so machine noise hits every variant alike.

    python bench/bench_train.py [--steps 20] [--seq-len 128] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockgen.models.backbone import SIZES
from blockgen.models.model import BlockGen, BlockGenConfig


def plain_ar_step(model: BlockGen, x: torch.Tensor, opt) -> None:
    """Causal LM step on L tokens with SDPA's causal kernel: the cost of a standard AR model."""
    dit = model.dit
    cond = dit.time(torch.zeros(x.shape[0]))
    h = dit.embed(x)
    rotary = dit.rotary.tables(torch.arange(x.shape[1])[None].expand(x.shape[0], -1))
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    for i, block in enumerate(dit.blocks):
        h = block(h, cond, rotary, causal, None, i, 0)
    logits = dit.final(h, cond)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def blockgen_step(model: BlockGen, x: torch.Tensor, block_size: int, opt) -> None:
    mask = torch.ones_like(x, dtype=torch.float)
    total, count = model(x, mask, block_size, torch.rand(x.shape[0]))
    (total / count).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = BlockGenConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, prior="masked", block_sizes=(1, args.block_size),
        block_weights=(0.05, 0.95), shape=SIZES["tiny"],
    )
    model = BlockGen(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    variants = {
        f"BlockGen L'={args.block_size} (2L)": lambda: blockgen_step(model, x, args.block_size, opt),
        "BlockGen L'=1 (2L)": lambda: blockgen_step(model, x, 1, opt),
        "plain causal AR (L)": lambda: plain_ar_step(model, x, opt),
    }
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.steps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"tiny model: {model.dit.n_params() / 1e6:.2f}M parameters, batch {args.batch} x L {args.seq_len}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} interleaved steps")
    ref = statistics.median(times["plain causal AR (L)"])
    print(f"{'variant':<26} {'median s/step':>14} {'steps/s':>8} {'tokens/s':>10} {'x plain AR':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<26} {med:>14.4f} {1 / med:>8.2f} {args.batch * args.seq_len / med:>10.0f} {med / ref:>11.2f}")


if __name__ == "__main__":
    main()
