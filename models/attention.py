"""The BlockGen attention pattern, defined once.

Every token carries a small layout record: its position (rotary), its block id, whether it is in the
clean or the noisy stream, and whether it is real (not padding). One rule, `allowed`, decides
whether a query may attend to a key. It is evaluated on whole grids to build an SDPA boolean mask
(CPU training, KV-cached sampling) and per index as a FlexAttention `mask_mod` (CUDA training).

The rule (paper appendix B, "clean first" layout):
- a noisy query sees the noisy keys of its own block and the clean keys of strictly earlier blocks;
- a clean query sees clean keys only: token-causally (mixture models: the clean keys and values do
  not depend on the block size, so one KV cache serves every block size) or block-causally;
- nobody sees padding (padding queries see themselves, so no softmax row is empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Layout:
    """Per-token layout of one forward pass; every field is a (B, N) tensor (B may be 1)."""

    positions: torch.Tensor  # rotary position
    block_ids: torch.Tensor  # block index; clean tokens of block b are visible to noisy block > b
    noisy: torch.Tensor  # bool: token belongs to the noisy stream
    valid: torch.Tensor  # bool: real token, not padding

    def cat(self, other: "Layout") -> "Layout":
        return Layout(*(torch.cat([a, b], dim=1) for a, b in zip(self._fields(), other._fields())))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return self.positions, self.block_ids, self.noisy, self.valid

    def expand(self, batch: int) -> "Layout":
        return Layout(*(f.expand(batch, -1) for f in self._fields()))

    def to(self, device: torch.device | str) -> "Layout":
        return Layout(*(f.to(device) for f in self._fields()))


def allowed(
    q_block: torch.Tensor,
    q_pos: torch.Tensor,
    q_noisy: torch.Tensor,
    k_block: torch.Tensor,
    k_pos: torch.Tensor,
    k_noisy: torch.Tensor,
    k_valid: torch.Tensor,
    causal_clean: bool,
) -> torch.Tensor:
    """Whether a query may attend to a key. Broadcasts; works on grids and on FlexAttention indices."""
    same_block = q_block == k_block
    noisy_sees = torch.where(k_noisy, same_block, k_block < q_block)
    clean_prefix = (k_pos <= q_pos) if causal_clean else (k_block <= q_block)
    clean_sees = ~k_noisy & clean_prefix
    return torch.where(q_noisy, noisy_sees, clean_sees) & k_valid


def dense_mask(queries: Layout, keys: Layout, causal_clean: bool, query_offset: int | torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, Nq, Nk) boolean SDPA mask. Padding queries attend to themselves only (never empty rows):
    query i is key `query_offset + i` (default: the queries are the last Nq keys; a 0-dim tensor: a
    static cache's offset, kept on the device)."""

    def q(x: torch.Tensor) -> torch.Tensor:
        return x[:, :, None]

    def k(x: torch.Tensor) -> torch.Tensor:
        return x[:, None, :]

    mask = allowed(
        q(queries.block_ids), q(queries.positions), q(queries.noisy),
        k(keys.block_ids), k(keys.positions), k(keys.noisy), k(keys.valid),
        causal_clean,
    )
    # A padding query (or one whose keys are all padding) would get an all-False row and NaNs: it
    # sees itself instead. Always applied (no `if empty.any()`: that would make a GPU wait on the host).
    n_q, n_k = mask.shape[-2:]
    offset = n_k - n_q if query_offset is None else query_offset
    itself = torch.arange(n_k, device=mask.device)[None] == torch.arange(n_q, device=mask.device)[:, None] + offset
    empty = ~mask.any(dim=-1, keepdim=True)
    return (mask | (empty & itself))[:, None]


def training_layout(seq_len: int, block_size: int, device: torch.device | str = "cpu") -> Layout:
    """Layout of `[x0 (clean, L) ; xt (noisy, L)]`: both halves share positions 0..L-1."""
    pos = torch.arange(seq_len, device=device)
    positions = torch.cat([pos, pos])[None]
    block_ids = positions // block_size
    noisy = torch.cat([torch.zeros(seq_len, dtype=torch.bool), torch.ones(seq_len, dtype=torch.bool)])
    return Layout(positions, block_ids, noisy[None].to(device), torch.ones_like(noisy)[None].to(device))


@lru_cache(maxsize=16)
def _training_mask(seq_len: int, block_size: int, causal_clean: bool, device: str) -> torch.Tensor:
    layout = training_layout(seq_len, block_size, device)
    return dense_mask(layout, layout, causal_clean)


def training_mask(seq_len: int, block_size: int, causal_clean: bool, device: str) -> torch.Tensor:
    """SDPA mask of the training layout, cached per block size (the same every step). A compiled training step
    takes it as a constant of its graph (`mark_masks_constant`): built once, not traced into every step."""
    return _training_mask(seq_len, block_size, causal_clean, device)


def mark_masks_constant() -> None:
    """Tell dynamo that `training_mask` is a pure function of its arguments, so each compiled graph holds the mask as
    a constant (dynamo traced through its cache instead, warning "lru_cache-wrapped function ... silent incorrectness").
    Called where compilation starts (`train.training_net`), not at import: `torch.compiler` imports dynamo, about 1 s
    and 800 modules that an eager process never needs."""
    torch.compiler.assume_constant_result(training_mask)  # marks the function itself


@lru_cache(maxsize=16)
def training_block_mask(seq_len: int, block_size: int, causal_clean: bool, device: str):
    """FlexAttention BlockMask of the training layout from the same `allowed` rule (CUDA path)."""
    from torch.nn.attention.flex_attention import create_block_mask

    layout = training_layout(seq_len, block_size, device)
    block, pos, noisy = layout.block_ids[0], layout.positions[0], layout.noisy[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(
            block[q_idx], pos[q_idx], noisy[q_idx],
            block[kv_idx], pos[kv_idx], noisy[kv_idx], torch.ones_like(noisy[kv_idx]),
            causal_clean,
        )

    n = 2 * seq_len
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)
