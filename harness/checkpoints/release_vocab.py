"""The tokenizer of a release as the authors prepare it ([PAD] added where it has none) and the embedding
rows it implies: gpt2's layout (the OWT releases: [MASK] is the added [PAD]) or the wrapped one (every
other tokenizer, SmolLM's for TinyGSM), checked against the rows of the weights."""

from __future__ import annotations

from blockgen.harness.checkpoints.checkpoint import WEIGHTS
from blockgen.harness.checkpoints.hub import HubUnavailableError
from blockgen.harness.checkpoints.release_paths import ReleaseError, ReleaseSetting


def release_rows(tokenizer, prior: str, gpt2: bool) -> int:
    """The authors' embedding rows for a tokenizer prepared as theirs ([PAD] added where it has none):
    absorb / MDLM / AR add the [MASK] row at their `vocab_size`, uniform / Duo have `len(tokenizer)` rows.
    Their `get_tokenizer` leaves gpt2 as it is (vocab_size 50257, len 50258: [MASK] is the added [PAD])
    and wraps every other tokenizer so that vocab_size == len."""
    if prior == "uniform":
        return len(tokenizer)
    return (tokenizer.vocab_size if gpt2 else len(tokenizer)) + 1


def release_tokenizer(name: str, rows: int, setting: ReleaseSetting, source: str, given: bool, prior_free: bool):
    """The tokenizer as the authors prepare it, checked against the embedding's rows. The layout (gpt2 or
    wrapped) follows the path's dataset; a path that names none takes either, the one the rows fit.
    `given`: the name is the user's tokenizer=; `prior_free`: prior= may still be chosen."""
    from blockgen.harness.checkpoints.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(name)
    except HubUnavailableError:
        if given:
            raise ReleaseError(f"tokenizer={name}: neither a folder with tokenizer files nor a hub name reachable "
                               f"from here; fix: tokenizer=<a folder with tokenizer.json, or vocab.json and merges.txt>") from None
        raise HubUnavailableError(f"{source}: its dataset {setting.dataset} reads the tokenizer {name}, which is neither "
                                  f"reachable on the hub nor in its cache; fix: tokenizer=<dir>, a local copy of {name} "
                                  f"(`huggingface-cli download {name} --local-dir DIR` where the hub is reachable)") from None
    added = tokenizer.pad_token is None
    if added:  # as the authors' get_tokenizer does
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    layouts = [setting.tokenizer == "gpt2"] if setting.tokenizer else [False, True]
    if any(release_rows(tokenizer, setting.prior, gpt2) == rows for gpt2 in layouts):
        return tokenizer
    want = " or ".join(str(n) for n in sorted({release_rows(tokenizer, setting.prior, gpt2) for gpt2 in layouts}))
    other = "uniform" if setting.prior == "masked" else "masked"
    if prior_free and any(release_rows(tokenizer, other, gpt2) == rows for gpt2 in layouts):
        fix = f"prior={other} (the rows fit it)"
    else:
        fix = "tokenizer=<dir> holding the tokenizer this model was trained with"
        fix += f" ({setting.tokenizer})" if setting.tokenizer else ""
    tokens = f"{len(tokenizer)} tokens{' with the added [PAD]' if added else ''}"
    raise ReleaseError(f"{source}/{WEIGHTS}: vocab_embed.embedding has {rows} rows, but the tokenizer {name} (vocab_size "
                       f"{tokenizer.vocab_size}, {tokens}) gives {want} for prior={setting.prior} (the authors' rule: "
                       f"uniform / Duo len(tokenizer), absorb / MDLM / AR vocab_size + 1, where vocab_size is "
                       f"len(tokenizer) for every tokenizer but gpt2); fix: {fix}")
