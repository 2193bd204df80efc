"""Sample from a checkpoint on the command line.

    blockgen sample --checkpoint runs/masked-mix/checkpoint --prompt "Tom has 3 apples." --sep \\
        --sampler arpc --steps 12 --ge 3 --temperature 0.1 --max-new-tokens 128
    blockgen sample --checkpoint DIR --prompt "Tom has 3 apples." --sep --sampler arpc --nfe 4   # the paper's variant
    blockgen sample --checkpoint DIR --prompt "" --num-samples 8 --out samples.jsonl

Each prompt is encoded as `[BOS] text` (`--no-bos` drops BOS, `--sep` appends the separator the
word-problem models were trained with). Prompts run in batches of `--batch-size`; sample j (in
the order printed) draws from its own generator seeded `--seed + j`, so repeated prompts get
different samples and no sample depends on the batch size. Prompts longer than the model's context
allows are cut from the left (with a warning). Samples are printed, and written
as JSON lines with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from blockgen.harness.checkpoints.checkpoint import CheckpointError, checkpoint_special_tokens, load_checkpoint
from blockgen.harness.runtime.distributed import resolve_device
from blockgen.harness.checkpoints.hub import HubUnavailableError
from blockgen.harness.evaluation.lm_eval_model.arguments import (check_budget, check_checkpoint_dir, largest_budget,
                                                                sampler_config_for)
from blockgen.harness.evaluation.paper_variants import settings_at
from blockgen.models import samplers
from blockgen.models.sampler_config import BLOCK_LAYOUTS, SamplerConfig
from blockgen.models.sampling import check_config, generate, max_prompt_len


def build_parser(p: argparse.ArgumentParser) -> None:
    """`blockgen sample` (mounted by harness/cli.py)."""
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json, model.safetensors, tokenizer), "
                   "or a released one: hf:jdeschena/blockgen/<subfolder> or its local folder")
    p.add_argument("--tokenizer", default=None, help="released checkpoints: a local copy of the setting's tokenizer")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; '' for unconditional)")
    p.add_argument("--prompts-file", type=Path, help="one prompt per line")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--no-bos", action="store_true", help="do not prepend BOS")
    p.add_argument("--sep", action="store_true", help="append the prompt/answer separator")
    defaults = SamplerConfig()
    p.add_argument("--sampler", choices=list(samplers.names()), default=defaults.name,
                   help="; ".join(f"{n}: {s.summary}" for n, s in samplers.load().items()))
    p.add_argument("--nfe", type=int, default=None, help="the paper's variant at this NFE per block (`blockgen variants "
                   "SAMPLER`), narrowed by any --steps/--ge/--warmup given; as lm-eval's nfe= model arg")
    p.add_argument("--steps", type=int, default=None, help="N_step: reverse steps per block (default: the block size)")
    p.add_argument("--ge", type=int, default=None, help=f"an informed step every GE steps (eipc, arpc; default {defaults.ge})")
    p.add_argument("--warmup", type=int, default=None, help=f"ancestral steps before the first informed one (default {defaults.warmup})")
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    for option in samplers.options().values():  # the samplers' own settings, as each declares it
        users = ", ".join(n for n, s in samplers.load().items() if option in s.options)
        p.add_argument(f"--{option.name.replace('_', '-')}", type=option.kind, default=None,
                       help=f"{option.help} ({users}; {option.range_text()}, default {option.default})")
    p.add_argument("--block-size", type=int, default=None, help="default: the largest trained block size")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="the generation budget (default: as many tokens as the model's context holds after the longest "
                        "prompt; a row ends sooner at EOS)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="sample j uses seed + j")
    p.add_argument("--layout", choices=list(BLOCK_LAYOUTS), default=defaults.layout,
                   help="grid: blocks on the training grid, the prompt's tail inside the first block; "
                        "prompt_end: a whole block right after the prompt")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (the GPU when there is one)")
    p.add_argument("--out", type=Path, help="write the samples as JSON lines")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no printed samples")


def run(args: argparse.Namespace) -> int:
    texts = list(args.prompt)
    if args.prompts_file:
        texts += args.prompts_file.read_text().splitlines()
    if not texts:
        print("blockgen sample: error: give --prompt (repeatable; '' for unconditional) or --prompts-file", file=sys.stderr)
        return 2
    try:
        from blockgen.harness.checkpoints.release_import import resolve
        from blockgen.harness.checkpoints.release_paths import ReleaseOverrides

        settings_at(args.sampler, args.nfe, args.steps, args.ge, args.warmup)  # a bad --nfe: its message, before any loading
        device = resolve_device(args.device)  # a device this machine lacks: the policy's message, before any loading
        if not str(args.checkpoint).startswith("hf:"):
            check_checkpoint_dir(args.checkpoint, "--checkpoint ")
        checkpoint = resolve(args.checkpoint, ReleaseOverrides(tokenizer=args.tokenizer))
        model, tokenizer = load_checkpoint(checkpoint, device=device)
        # the same rule as lm-eval's --model_args (steps default to the block size, nfe picks the variant)
        config = sampler_config_for(model.config, args.sampler, nfe=args.nfe, steps=args.steps, ge=args.ge, warmup=args.warmup,
                                 temperature=args.temperature, block_size=args.block_size,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, layout=args.layout,
                                 options=tuple((name, getattr(args, name)) for name in samplers.options()
                                               if getattr(args, name) is not None))
        check_config(model, config)
        check_budget(model.config, config, "--max-new-tokens")
    except (ValueError, CheckpointError, HubUnavailableError) as err:  # releases' errors are CheckpointErrors
        print(f"blockgen sample: error: {err}", file=sys.stderr)
        return 2
    special = checkpoint_special_tokens(model, tokenizer)
    prompts = [([] if args.no_bos else [special.bos]) + tokenizer.encode(text, add_special_tokens=False)
               + (list(special.sep) if args.sep else []) for text in texts]
    if args.max_new_tokens is None:  # fill the context after the longest prompt (EOS ends a row sooner); when a prompt
        room = largest_budget(model.config, config, max(map(len, prompts)))  # leaves none: lm-eval's budget, prompts cut
        config = replace(config, max_new_tokens=room or config.max_new_tokens)

    limit = max_prompt_len(model, config)
    jobs: list[tuple[int, list[int]]] = []  # (prompt index, token ids)
    for j, ids in enumerate(prompts):
        if len(ids) > limit:
            print(f"blockgen sample: warning: prompt {j} has {len(ids)} tokens; keeping the last {limit}", file=sys.stderr)
            ids = ids[len(ids) - limit :]
        jobs += [(j, ids)] * args.num_samples

    records = []
    bar = tqdm(total=len(jobs) * config.max_new_tokens, unit="tok", disable=args.quiet, file=sys.stderr)
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start : start + args.batch_size]
        done = 0

        def progress(n: int, size: int = len(batch)) -> None:
            nonlocal done
            step = min(n, config.max_new_tokens - done)
            done += step
            bar.update(step * size)

        result = generate(
            model, [ids for _, ids in batch], config, eos_id=special.eos, pad_id=special.pad, progress=progress,
            seeds=[config.seed + start + r for r in range(len(batch))],
        )
        bar.update((config.max_new_tokens - done) * len(batch))  # rows that stopped early
        for r, ((j, ids), tokens, reason) in enumerate(zip(batch, result.tokens, result.finish_reasons)):
            records.append({
                "prompt_index": j,
                "prompt": texts[j],
                "completion": tokenizer.decode(tokens),
                "tokens": tokens,
                "finish_reason": reason,
                "model_calls": result.model_calls,
                "model_calls_per_block": result.model_calls_per_block,
                "paper_nfe_per_block": result.paper_nfe_per_block,
                "block_size": result.block_size,
                "row_calls": result.row_calls[r],  # this sample's own calls (an adaptive sampler's rows differ)
                "row_blocks": result.row_blocks[r],
            })
    bar.close()

    if not args.quiet:
        for i, r in enumerate(records):
            print(f"=== sample {i} (prompt {r['prompt_index']}, {r['finish_reason']}, {len(r['tokens'])} tokens) ===")
            print(f"prompt: {r['prompt']}\nanswer: {r['completion']}")
        r = records[-1]
        calls, blocks = sum(x["row_calls"] for x in records), sum(x["row_blocks"] for x in records)
        label = "none: adaptive" if r["paper_nfe_per_block"] is None else r["paper_nfe_per_block"]
        print(f"# sampler {config.name}: {calls / max(blocks, 1):.2f} model calls per block per sample "
              f"(paper NFE label {label}), {sum(len(x['tokens']) for x in records) / max(calls, 1):.2f} generated "
              f"tokens per call, block size {r['block_size']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"checkpoint": str(args.checkpoint), "sampler": config.as_dict()}
        with open(args.out, "w") as f:
            for r in records:
                f.write(json.dumps({**r, **meta}) + "\n")
    return 0
