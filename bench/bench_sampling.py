"""Sampler timings, measured side by side in one run (random weights: timing only, not quality).

    .venv/bin/python bench/bench_sampling.py                  # prompt 128 + 512 new tokens, L' = 16
    .venv/bin/python bench/bench_sampling.py --new-tokens 256 --repeats 1
    .venv/bin/python bench/bench_sampling.py --scaling           # generate() tokens/s vs batch size
    .venv/bin/python bench/bench_sampling.py --overhead --base 3f168d8   # sampler overhead, base vs now

For NFE per block in {4, 8, 16} it reports
- tokens/s of block-by-block ancestral sampling with the KV cache vs recomputing the whole prefix at
  every call (`generate(..., use_cache=False)`); goal: cached >= 5x;
- wall time per model call of ARPC vs ancestral at the same paper NFE label (ARPC's AR passes run
  2 L' tokens; every block's first call also carries the previous block); goal: <= 1.25x;
- block-by-block (L' = 16) vs full-sequence diffusion (one block of all new tokens) at matched
  total NFE. The full-sequence run uses a block size the model was never trained on: a timing
  comparison only.
Model: the tiny project config (vocab 512, 4 layers, d 192, 4 heads; block sizes (1, 16)).
With `--scaling` it instead reports generate()'s tokens/s at batch 1, 4, 16 and 64 side by side
(micro and tiny sizes, prompts of mixed lengths 32-64 on the grid layout, 64 new tokens, per-row
seeds), as a ratio to batch 1: how much batching pays, per-row randomness included.
With `--overhead` it reports each sampler's **overhead ratio**: the wall time of generate() divided
by the time spent inside the network's forward passes it made (`DiT.forward_cached`, timed around
every call on the same tensors; ARPC's AR passes included), at batch 1 and 32, micro and tiny sizes.
1.0 means every moment goes to the network; the rest is the sampler's own work (draws, posteriors,
layouts, bookkeeping), which on a GPU also keeps the device waiting. `--base REV` runs the same
measurement on a git revision's code (a temporary worktree) in alternation with the working tree's,
and prints both side by side.
EOS is disabled (eos_id = -1) so every run generates exactly the requested tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import replace

import torch

from blockgen.models.backbone import SIZES
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.sampler_config import SamplerConfig
from blockgen.models.sampling import generate

# (N_step, GE, warmup) of ARPC with the paper's NFE label 4, 8, 16 (appendix D's rule)
ARPC_SCHEDULES = {4: (3, 3, 0), 8: (6, 3, 0), 16: (12, 3, 0)}


def tiny_model(seq_len: int, prior: str, size: str = "tiny") -> BlockGen:
    config = BlockGenConfig(
        vocab_size=512, seq_len=seq_len, prior=prior, block_sizes=(1, 16), block_weights=(0.05, 0.95),
        shape=replace(SIZES[size], dropout=0.0),
    )
    model = BlockGen(config).eval()
    with torch.no_grad():  # non-trivial outputs (the final layer is zero-initialised)
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def timed(model, prompts, runs: dict[str, tuple[SamplerConfig, dict]], repeats: int) -> dict[str, tuple[float, int]]:
    """{name: (best wall seconds, model calls)}; the runs alternate round-robin, so load from other
    processes on the machine hits every variant alike."""
    best: dict[str, tuple[float, int]] = {}
    for _ in range(repeats):
        for name, (config, kwargs) in runs.items():
            start = time.perf_counter()
            result = generate(model, prompts, config, eos_id=-1, pad_id=0, **kwargs)
            seconds = time.perf_counter() - start
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, result.model_calls)
    return best


def scaling(batches: list[int], repeats: int, prior: str) -> None:
    """generate() tokens/s at several batch sizes, side by side, as a ratio to batch 1."""
    new_tokens, lengths = 64, (32, 64)
    samplers = {"arpc(3,3,0)": SamplerConfig("arpc", steps=3, ge=3, max_new_tokens=new_tokens),
                "ancestral N4": SamplerConfig("ancestral", steps=4, max_new_tokens=new_tokens),
                "ar_greedy": SamplerConfig("ar_greedy", max_new_tokens=new_tokens)}
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, 512, (int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(max(batches))]
    print(f"generate() batch scaling: prompts of {lengths[0]}-{lengths[1]} tokens, {new_tokens} new tokens, "
          f"L' = 16, grid layout, per-row seeds, {torch.get_num_threads()} threads, best of {repeats}")
    header = ["model", "sampler"] + [f"b{b} tok/s" for b in batches] + [f"b{b}/b1" for b in batches[1:]] + ["load1"]
    print(" | ".join(f"{h:>13}" for h in header))
    for size in ("micro", "tiny"):
        model = tiny_model(lengths[1] + new_tokens, prior, size)
        generate(model, pool[:2], SamplerConfig("ancestral", steps=2, max_new_tokens=16), -1, 0)  # warm-up
        for name, config in samplers.items():
            best = {b: float("inf") for b in batches}
            for _ in range(repeats):  # round-robin over batch sizes: machine load hits each alike
                for b in batches:
                    start = time.perf_counter()
                    generate(model, pool[:b], config, -1, 0, seeds=list(range(b)))
                    best[b] = min(best[b], time.perf_counter() - start)
            rate = {b: b * new_tokens / best[b] for b in batches}
            cells = [size, name] + [f"{rate[b]:.0f}" for b in batches] + [f"{rate[b] / rate[batches[0]]:.2f}" for b in batches[1:]]
            cells.append(f"{os.getloadavg()[0]:.2f}")
            print(" | ".join(f"{c:>13}" for c in cells))


OVERHEAD_SAMPLERS = {"ancestral N4": SamplerConfig("ancestral", steps=4), "eipc N4 GE2": SamplerConfig("eipc", steps=4, ge=2),
                     "arpc (3,2,1)": SamplerConfig("arpc", steps=3, ge=2, warmup=1), "ar_greedy": SamplerConfig("ar_greedy"),
                     "ar_sample": SamplerConfig("ar_sample")}


def overhead(repeats: int, batches=(1, 32), prompt_len: int = 32, new_tokens: int = 64) -> list[dict]:
    """Per model size, batch and sampler: generate()'s wall time / time inside the network's forwards."""
    rows = []
    for size in ("micro", "tiny"):
        model = tiny_model(prompt_len + new_tokens, "masked", size)
        inside = [0.0]
        network = model.dit.forward_cached

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            out = network(*args, **kwargs)
            inside[0] += time.perf_counter() - start
            return out

        model.dit.forward_cached = timed_forward
        gen = torch.Generator().manual_seed(0)
        for batch in batches:
            prompts = torch.randint(0, 512, (batch, prompt_len), generator=gen).tolist()
            generate(model, prompts, SamplerConfig("ancestral", steps=2, max_new_tokens=16), -1, 0, seeds=list(range(batch)))
            for name, config in OVERHEAD_SAMPLERS.items():
                config = replace(config, max_new_tokens=new_tokens, temperature=0.7)
                best = None
                for _ in range(repeats):
                    inside[0] = 0.0
                    start = time.perf_counter()
                    result = generate(model, prompts, config, -1, 0, seeds=list(range(batch)))
                    wall = time.perf_counter() - start
                    if best is None or wall < best["wall_s"]:
                        best = {"size": size, "batch": batch, "sampler": name, "wall_s": wall, "network_s": inside[0],
                                "calls": result.model_calls}
                rows.append(best)
    return rows


def overhead_side_by_side(base: str, repeats: int, threads: int) -> None:
    """The overhead table for `base` (a git revision) and the working tree, runs alternating."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree, package = Path(tmp) / "tree", Path(tmp) / "pkg"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "--quiet", str(tree), base], check=True)
        try:
            package.mkdir()
            (package / "blockgen").symlink_to(tree)  # the base's modules shadow the editable install
            variants = {base: {**os.environ, "PYTHONPATH": str(package)}, "now": dict(os.environ)}
            best: dict[str, dict[tuple, dict]] = {v: {} for v in variants}
            for _ in range(repeats):  # alternate: machine load hits both alike
                for name, env in variants.items():
                    out = subprocess.run([sys.executable, __file__, "--overhead", "--json", "--repeats", "1", "--threads", str(threads)],
                                         env=env, cwd=tmp, capture_output=True, text=True, check=True).stdout
                    for row in json.loads(out):
                        key = (row["size"], row["batch"], row["sampler"])
                        if key not in best[name] or row["wall_s"] < best[name][key]["wall_s"]:
                            best[name][key] = row
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"overhead ratio = generate() wall time / time inside the network's forwards; masked prior, prompt 32, "
          f"64 new tokens, L' = 16, {threads} thread(s), best of {repeats} per variant, alternating; load1 {os.getloadavg()[0]:.2f}")
    header = ["size", "batch", "sampler", f"{base} ratio", "now ratio", f"{base} ms/call", "now ms/call", "calls"]
    print(" | ".join(f"{h:>14}" for h in header))
    for key, now in best["now"].items():
        old = best[base][key]
        cells = [*key, f"{old['wall_s'] / old['network_s']:.2f}", f"{now['wall_s'] / now['network_s']:.2f}",
                 f"{1e3 * old['wall_s'] / old['calls']:.2f}", f"{1e3 * now['wall_s'] / now['calls']:.2f}", now["calls"]]
        print(" | ".join(f"{c:>14}" for c in cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--nfe", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--prior", choices=["masked", "uniform"], default="masked")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-full", action="store_true", help="skip the full-sequence comparison")
    parser.add_argument("--scaling", action="store_true", help="only the batch-size table (micro and tiny models)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="with --scaling")
    parser.add_argument("--overhead", action="store_true", help="only the overhead ratios (micro and tiny, batch 1 and 32)")
    parser.add_argument("--base", help="with --overhead: a git revision measured side by side with the working tree")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # --overhead's rows, for --base
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.overhead:
        if args.base:
            overhead_side_by_side(args.base, args.repeats, args.threads)
            return
        with torch.inference_mode():
            rows = overhead(args.repeats)
        if args.json:
            print(json.dumps(rows))
            return
        for row in rows:
            print(f"{row['size']:>6} b{row['batch']:<3} {row['sampler']:<14} ratio {row['wall_s'] / row['network_s']:.2f} "
                  f"{1e3 * row['wall_s'] / row['calls']:.2f} ms/call")
        return
    if args.scaling:
        with torch.inference_mode():
            scaling(args.batch_sizes, args.repeats, args.prior)
        return
    torch.manual_seed(0)
    block = 16
    model = tiny_model(args.prompt_len + args.new_tokens, args.prior)
    prompts = torch.randint(0, 512, (args.batch, args.prompt_len)).tolist()
    n_tok = args.batch * args.new_tokens
    print(f"tiny model ({model.dit.n_params() / 1e6:.2f}M params, {args.prior}), batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, L' = {block}, {torch.get_num_threads()} threads")

    with torch.inference_mode():
        generate(model, prompts, SamplerConfig("ancestral", steps=2, max_new_tokens=2 * block), -1, 0)  # warm-up
        rows = []
        for nfe in args.nfe:
            anc = SamplerConfig("ancestral", steps=nfe, block_size=block, max_new_tokens=args.new_tokens)
            steps, ge, warmup = ARPC_SCHEDULES.get(nfe, (nfe, nfe, 0))
            arpc = SamplerConfig("arpc", steps=steps, ge=ge, warmup=warmup, block_size=block, max_new_tokens=args.new_tokens)
            runs = {"cached": (anc, {}), "uncached": (anc, {"use_cache": False}), "arpc": (arpc, {})}
            if not args.skip_full:  # one block of all new tokens, the same total number of calls
                total = nfe * (args.new_tokens // block)
                full = SamplerConfig(  # one block right after the prompt: the grid would put the prompt inside it
                    "ancestral", steps=total, block_size=args.new_tokens, max_new_tokens=args.new_tokens, layout="prompt_end"
                )
                runs["full"] = (full, {"validate": False})
            t = timed(model, prompts, runs, args.repeats)
            (t_cached, c_cached), (t_plain, _), (t_arpc, c_arpc) = t["cached"], t["uncached"], t["arpc"]
            row = {
                "nfe/block": nfe,
                "cached tok/s": n_tok / t_cached,
                "uncached tok/s": n_tok / t_plain,
                "cache speedup": t_plain / t_cached,
                "anc ms/call": 1e3 * t_cached / c_cached,
                "arpc ms/call": 1e3 * t_arpc / c_arpc,
                "arpc/anc": (t_arpc / c_arpc) / (t_cached / c_cached),
            }
            if "full" in t:
                t_full, c_full = t["full"]
                row.update({"calls": c_cached, "block-wise s": t_cached, "full-seq s": t_full, "full/block": t_full / t_cached})
                assert c_full == c_cached
            row["load1"] = os.getloadavg()[0]  # other processes on this machine skew the timings
            rows.append(row)

    keys = list(rows[0])
    print(" | ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print(" | ".join(f"{row[k]:>14.2f}" if isinstance(row[k], float) else f"{row[k]:>14}" for k in keys))
    print("goals: cache speedup >= 5x; arpc/anc per call <= 1.25x. full-seq: timing only (untrained block size).")
    print(f"load1 = 1-minute load average after the row; above {torch.get_num_threads()} the machine was shared.")


if __name__ == "__main__":
    main()
