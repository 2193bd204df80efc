"""Tokenizers: a byte-level BPE trained locally (`DataConfig.tokenizer = "local"`, the default) or a hub tokenizer.

Whatever the source, the rest of the code sees a `transformers.PreTrainedTokenizerFast` and a
`SpecialTokens` record. BOS may equal EOS (GPT-2): code that stops at EOS must never look at a
prompt's first token. PAD is never the diffusion [MASK] (that id lies past the vocabulary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from blockgen.harness.checkpoints.hub import hub_call

BOS, EOS, PAD, SEP = "<|bos|>", "<|eos|>", "<|pad|>", "<|sep|>"


@dataclass(frozen=True)
class SpecialTokens:
    bos: int
    eos: int
    pad: int
    sep: tuple[int, ...]  # separates a prompt from its answer (one special token, or e.g. "\n")

    def to_dict(self) -> dict:
        return {**asdict(self), "sep": list(self.sep)}  # JSON-shaped, so configs compare equal

    @classmethod
    def from_dict(cls, d: dict) -> "SpecialTokens":
        return cls(bos=d["bos"], eos=d["eos"], pad=d["pad"], sep=tuple(d["sep"]))


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path | None = None, split_digits: bool = False):
    """Train a byte-level BPE on `texts` and wrap it as a Hugging Face fast tokenizer.

    `split_digits`: every digit is its own token (and the space before a number too), so a number is
    spelled by the same ten tokens wherever it stands: "$48" and "= 48" share "4", "8", where a plain
    BPE has "48" in one and " 48" in the other, two tokens a model must learn to map onto each other.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, SEP],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, sep_token=SEP)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(name_or_path: str | Path):
    """A local directory, or a hub name (fails with a clear message when the hub is unreachable)."""
    from transformers import AutoTokenizer

    return hub_call(lambda: AutoTokenizer.from_pretrained(str(name_or_path)), f"tokenizer {name_or_path}")


def special_tokens(tokenizer) -> SpecialTokens:
    """BOS/EOS/PAD/SEP ids; tokenizers without PAD pad with EOS, without SEP separate with a newline."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if tokenizer.sep_token_id is not None:
        sep = (tokenizer.sep_token_id,)
    else:
        sep = tuple(tokenizer.encode("\n", add_special_tokens=False))
    return SpecialTokens(bos=bos, eos=eos, pad=pad, sep=sep)
