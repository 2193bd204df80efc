"""Does a checkpoint copy numbers from the question? Teacher-forced next-token accuracy on programs.

For each trained block size: `forward_train` of validation problems with a fully noised x_t (every
position predicted from the clean prefix, as the first step of a block does), argmax against x_0, over
all program tokens and over the number tokens alone. A model that writes the right template but the
wrong numbers has a high first figure and a low second one.

    python bench/probe_copying.py runs/demo/gsm-masked-mix/checkpoint [--problems 32] [--difficulty easy]
"""

from __future__ import annotations

import argparse

import torch

from blockgen.harness.checkpoints.checkpoint import load_checkpoint
from blockgen.harness.data.sources import encode_problems
from blockgen.harness.checkpoints.tokenizer import special_tokens
from blockgen.harness.data.wordproblems import DEFAULT_DIFFICULTY, generate, to_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--difficulty", default=DEFAULT_DIFFICULTY)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_checkpoint(args.checkpoint)
    problems = to_records(generate("validation", args.problems, 0, args.difficulty))
    val, _ = encode_problems(problems, tokenizer, special_tokens(tokenizer), model.config.seq_len)
    x0, program = val.tokens, val.loss_mask
    is_number = torch.tensor([[tokenizer.decode([t]).strip().isdigit() for t in row] for row in x0.tolist()]) & program
    with torch.inference_mode():
        for block_size in model.mixture.sizes:
            right = model.dit.forward_train(x0, model.prior.fully_noised(x0.shape), block_size).argmax(-1) == x0
            print(f"block size {block_size:>2}: program tokens {float((right & program).sum() / program.sum()):.3f}, "
                  f"number tokens {float((right & is_number).sum() / is_number.sum()):.3f} "
                  f"({int(is_number.sum())} of {int(program.sum())} tokens, {len(val)} problems)")


if __name__ == "__main__":
    main()
