"""generate_until throughput of the lm-eval adapter by batch size, measured side by side in one run.

    .venv/bin/python bench/bench_generate.py                  # micro and tiny, batch 1, 4, 8, 16, 64
    .venv/bin/python bench/bench_generate.py --models tiny --batch-sizes 1 16 --repeats 1
    .venv/bin/python bench/bench_generate.py --device cuda --models paper --batch-sizes 1 64

Each model is a checkpoint with RANDOM weights (timing only, not quality) and a byte-level BPE
trained on the toy text, written to a temporary folder. 64 requests (toy prompts of 6-40 tokens,
``until: ["\\n\\n"]``, max_gen_toks 64, the default sampler: ancestral, L' = 8, 8 steps per block)
go through ``BlockGenLM.generate_until`` exactly as lm-eval sends them; tokens/s counts the tokens
really generated (EOS ends a row early). The batch sizes run round-robin, best of ``--repeats``, so
load from other processes hits every column alike; the load average is printed with the table.
Goals on a 2-core CPU: micro at batch 8 >= 2x batch 1, tiny at batch 16 >= 1.5x batch 1.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from blockgen.models.backbone import SIZES


def random_checkpoint(out: Path, size: str, seq_len: int) -> Path:
    from blockgen.harness.checkpoints.checkpoint import save_checkpoint
    from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
    from blockgen.models.model import BlockGen, BlockGenConfig
    from blockgen.tasks.blockgen_toy import training_text

    tok = train_bpe(training_text(2000), vocab_size=512)
    config = BlockGenConfig(vocab_size=len(tok), seq_len=seq_len, prior="masked", block_sizes=(1, 8),
                            block_weights=(0.2, 0.8), shape=replace(SIZES[size], dropout=0.0),
                            special_tokens=special_tokens(tok).to_dict())
    torch.manual_seed(0)
    model = BlockGen(config).eval()
    with torch.no_grad():  # non-trivial outputs (the final layer is zero-initialised)
        for p in model.parameters():
            p.normal_(0, 0.05)
    return save_checkpoint(out, model, tok)


def requests(n: int):
    from lm_eval.api.instance import Instance

    from blockgen.tasks.blockgen_toy import addition, sentence

    rng = random.Random(0)
    prompts = [" ".join(sentence(rng) for _ in range(rng.randint(0, 5))) + " " + addition(rng)[0] for _ in range(n)]
    gen = {"until": ["\n\n"], "max_gen_toks": 64}
    return [Instance("generate_until", {}, (p.strip(), gen), i, ("bench", i, 1)) for i, p in enumerate(prompts)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["micro", "tiny"], choices=list(SIZES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from blockgen.harness.evaluation.lm_eval_model.model import BlockGenLM

    reqs = requests(args.requests)
    header = " | ".join(f"batch {b} tok/s" for b in args.batch_sizes)
    print(f"| model | {header} | " + " | ".join(f"batch {b} / batch 1" for b in args.batch_sizes[1:]) + " |")
    print("|---" * (1 + 2 * len(args.batch_sizes) - 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.models:
            checkpoint = random_checkpoint(Path(tmp) / size, size, args.seq_len)
            lms = {b: BlockGenLM(pretrained=str(checkpoint), device=args.device, batch_size=b, seed=0) for b in args.batch_sizes}
            best: dict[int, float] = {}
            texts = {}
            for _ in range(args.repeats):
                for b, lm in lms.items():
                    lm.usage = type(lm.usage)()
                    start = time.perf_counter()
                    texts[b] = lm.generate_until(reqs, disable_tqdm=True)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - start
                    tokens = lm.usage.report()["bench"]["generate_until"]["generated_tokens"]
                    best[b] = max(best.get(b, 0.0), tokens / seconds)
            first = texts[args.batch_sizes[0]]
            differ = {b: sum(x != y for x, y in zip(first, t)) for b, t in texts.items() if b != args.batch_sizes[0]}
            base = best[args.batch_sizes[0]]
            print(f"| {size} | " + " | ".join(f"{best[b]:.0f}" for b in args.batch_sizes) + " | "
                  + " | ".join(f"{best[b] / base:.1f}x" for b in args.batch_sizes[1:]) + " |", flush=True)
            if any(differ.values()):  # a float-rounding flip of one inverse-CDF draw (models/sampling.py)
                print(f"  texts that differ from batch {args.batch_sizes[0]}: {differ}", flush=True)
    print(f"load average {os.getloadavg()}, {args.threads} thread(s), device {args.device}, {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
