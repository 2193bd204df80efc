"""The DiT denoiser (paper appendix B): rotary positions, bias-free LayerNorm, adaLN fed a constant.

The network is time-unconditional: adaLN is kept (zero-initialised) but its conditioning vector is
the embedding of t = 0 for every token, so the clean stream's keys and values never depend on the
noise level and can be cached. The block size is an argument of the forward pass (through the
attention layout), never of the model.

The network's size is a `ModelShape` (named ones in `SIZES`), declared here once. Its options
(`BackboneConfig`), so the baselines and other code bases' networks are this one network:
- `architecture`: "blockgen" runs `[x0 ; xt]` with the BlockGen mask; "ar" is a plain causal
  transformer over the clean tokens (row i predicts token i + 1); "full_sequence" is one
  bidirectional pass over the noisy sequence only (MDLM, Duo).
- `adaln=False`: no conditioning at all (no time MLP, no adaLN; gates are 1), as the authors' AR.
- `time_conditioning=True`: the conditioning embeds sigma = -log alpha_t (Duo) instead of 0; only
  for the full-sequence network, whose passes have no clean cache to keep noise-independent.
- `cond_silu=True`: c = silu(MLP(e(sigma))), the authors' DiT; this project's own models feed
  MLP(e(t)) to adaLN directly.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from blockgen.models.attention import Layout, dense_mask, training_block_mask, training_layout, training_mask

ARCHITECTURES = ("blockgen", "ar", "full_sequence")


@dataclass(frozen=True)
class ModelShape:
    """The network's size: the one place these fields are declared. `BlockGenConfig` holds one (its
    config.json keeps the fields flat, at the top level), `BackboneConfig` passes it to the DiT, and
    `SIZES` names the ones training presets pick (`TrainConfig.size`). Defaults: the paper's DiT."""

    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    cond_dim: int = 128  # width of the adaLN conditioning vector
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


# The named shapes (`TrainConfig.size`, `--size`); parameter counts pinned in tests/test_config.py.
SIZES: dict[str, ModelShape] = {
    "micro": ModelShape(n_layers=2, d_model=64, n_heads=4, cond_dim=32, dropout=0.0),  # tests and CI
    "tiny": ModelShape(n_layers=4, d_model=192, n_heads=4, cond_dim=64, dropout=0.0),  # ~2M params
    "paper": ModelShape(n_layers=12, d_model=768, n_heads=12, cond_dim=128, dropout=0.1),  # ~170M with 50k vocab
}


@dataclass(frozen=True)
class BackboneConfig:
    vocab_size: int  # size of the model's input/output alphabet (tokenizer vocabulary + [MASK] if any)
    shape: ModelShape = ModelShape()
    max_len: int = 1024
    causal_clean: bool = True  # token-causal clean stream (one KV cache for every block size)
    attention: Literal["sdpa", "flex"] = "sdpa"
    architecture: Literal["blockgen", "ar", "full_sequence"] = "blockgen"  # see the module docstring
    adaln: bool = True  # False: no conditioning vector, no adaLN (the authors' AR)
    time_conditioning: bool = False  # condition on sigma = -log alpha_t (full_sequence only: Duo)
    cond_silu: bool = False  # c = silu(MLP(e(sigma))) as the authors' DiT; False: MLP(e(t))

    def __post_init__(self) -> None:
        if self.attention not in ("sdpa", "flex"):
            raise ValueError(f"attention={self.attention!r}; choose 'sdpa' or 'flex'")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; choose one of {list(ARCHITECTURES)}")
        if self.time_conditioning and (self.architecture != "full_sequence" or not self.adaln):
            raise ValueError("time_conditioning=True needs architecture='full_sequence' and adaln=True: a BlockGen "
                             "clean stream must not depend on the noise level (its keys and values are cached)")

    def to_dict(self) -> dict:
        return asdict(self)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_len: int, base: float = 10_000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_len).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for (B, N) positions, shaped (B, 1, N, D) to rotate (B, H, N, D); once per forward."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding in the rotate-half form: pairs (i, i + D/2) turn by the same angle."""
    cos, sin = tables
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and no bias."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float()).to(x.dtype)


# Row-invariant mode (`DiT.row_invariant`): every linear layer multiplies chunks of this many token rows, so the
# matrix kernel sees one shape whatever the batch (bench/README.md, "Batch invariance").
INVARIANT_ROWS = 8
# ... and a generation's first call (the prompts) is left-padded to a multiple of this many tokens, so that a row's
# tokens sit at the same place in every chunk of rows and queries alone and in any batch (a chunk's rows may be
# computed differently by place: MKL's AVX2 GEMMs do; likelihood windows use the same buckets)
INVARIANT_WIDTH = 32
# ... and attention multiplies chunks of this many query rows (a block of L' = 16 is one chunk; generation with
# smaller blocks passes 2 L', a call's most)
INVARIANT_QUERY_ROWS = 16
# ... against chunks of this many keys (a batch adds chunks past a row's keys; they change nothing); a row's span, the
# keys `per_span_attention` gives it, is whole chunks of it
INVARIANT_KEY_ROWS = 64


# On a GPU, cuBLAS picks its algorithm (split-K included) by the whole batched call's shape, the matrix count
# included: there every batched product of the mode runs in groups of exactly this many matrices (docs/lm_eval.md,
# "Batch invariance on a GPU"). A CPU's batched GEMM rounds a matrix the same whatever the count (tested), so none.
INVARIANT_MATRIX_GROUP: dict[str, int] = {"cuda": 16}


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)`, each product independent of how many there are. On a CPU a batch of one is dispatched to
    the plain GEMM, which rounds otherwise (measured: 3.8e-5 on a (64 x 1024) x (1024 x 256) product), so it runs
    as two, the operands' layouts kept. Where `INVARIANT_MATRIX_GROUP` names the device, the products run in groups
    of exactly that many, in one layout: an operand shared by every product (`shared`) stays shared, the others are
    copied contiguous and padded with zero matrices."""
    count, group = a.shape[0], INVARIANT_MATRIX_GROUP.get(a.device.type)
    if group is None:
        if count == 1:
            return torch.bmm(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1]
        return torch.bmm(a, b)
    padded = -(-count // group) * group

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.stride(0) == 0:
            return t[:1].expand(padded, *t.shape[1:])
        return torch.cat([t, t.new_zeros(padded - count, *t.shape[1:])])  # contiguous, padded or not

    a, b = fill(a), fill(b)
    return torch.cat([torch.bmm(a[i : i + group], b[i : i + group]) for i in range(0, padded, group)])[:count]


def shared(matrix: torch.Tensor, count: int) -> torch.Tensor:
    """`count` views of one matrix as a batch, with batch stride 0 even for a count of one (`expand` keeps a size-one
    dimension's stride), so `invariant_bmm` sees the same layout whatever the count."""
    return matrix.as_strided((count, *matrix.shape), (0, *matrix.stride()))


def fixed_shape_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                       weight_t: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with a result per token row that does not depend on how many rows there are.

    A CPU GEMM chooses its blocking, and so its order of summation, by the shape (M, K, N): a row's result moves by
    ~1e-6 relative with M. Here the rows are cut into chunks of exactly `rows` (the last one zero-padded) and
    multiplied as one batched GEMM of (rows, K) x (K, N) matrices (`invariant_bmm`); a (B, n, K) input's batch rows
    each start a chunk (padded to whole chunks), because a token's result may depend on its place in the chunk (MKL's
    AVX2 GEMMs: measured), and it does not depend on the chunk count (tests/test_row_invariant.py). `weight_t`: `weight.t()` made contiguous, if the caller keeps one (the batched GEMM ran
    ~1.2x faster on it than on the transposed view, measured on the tiny model's shapes)."""
    if x.dim() == 3 and x.shape[1] % rows:  # every batch row starts a chunk, so its tokens sit at the same places alone
        return fixed_shape_linear(F.pad(x, (0, 0, 0, rows - x.shape[1] % rows)), weight, bias, rows, weight_t)[:, : x.shape[1]]
    *lead, k = x.shape
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    n = max(1, -(-m // rows))
    if n * rows != m:
        flat = F.pad(flat, (0, 0, 0, n * rows - m))
    weight_t = weight.t() if weight_t is None else weight_t
    out = invariant_bmm(flat.view(n, rows, k), shared(weight_t, n)).view(n * rows, -1)[:m]
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (the same parameters and state-dict keys) that runs `fixed_shape_linear` while `rows` is set
    (`DiT.row_invariant`, which also keeps the weight's contiguous transpose in `weight_t` for that while)."""

    rows: int | None = None
    weight_t: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return super().forward(x)
        return fixed_shape_linear(x, self.weight, self.bias, self.rows, self.weight_t)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


@dataclass
class KVCache:
    """Keys and values of committed clean tokens, per layer, in buffers written in place.

    Each layer's keys and values live in one (B, H, capacity, D) buffer allocated at the first call
    (`capacity`: the slots a generation will need, which the sampler knows; a call that needs more
    grows the buffers once). A call writes the keys and values of all its tokens at slots
    `length, length + 1, ...` and attends to the slots written so far; only its first `n_commit`
    tokens stay (`length` advances by n_commit), the rest are overwritten by the next call. No
    `torch.cat` per block. The default slices the buffers at the host's `length`, which on a CPU
    computes the same numbers as a cache of exactly the prefix.

    `static=True` (`DiT.forward_static`) is what a captured CUDA graph needs: every call attends to
    every slot, the unwritten ones masked out, and writes at `start` (a 0-dim device tensor that
    follows `length`; the host never reads it back, it knows `length`) with `index_copy_`, so the
    tensors of a call depend only on (batch, query tokens, capacity), never on how far the
    generation has come. Its buffers are marked static addresses (written in place by a graph).
    """

    capacity: int = 0
    static: bool = False
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer (B, H, capacity, D), rotary applied
    values: list[torch.Tensor] = field(default_factory=list)
    layout: Layout | None = None  # (B, capacity) per field; slots >= the written ones are padding
    length: int = 0  # committed slots
    start: torch.Tensor | None = None  # static: `length` as a 0-dim long tensor on the device

    def __len__(self) -> int:
        return self.length

    def reserve(self, layout: Layout) -> Layout:
        """Write the layout of a call's tokens at slots length.. (growing the buffers if needed);
        returns the keys' layout the call attends to (the default, sliced mode)."""
        end = self.prepare(layout)
        for buffer, new in zip(self.layout._fields(), layout._fields()):
            buffer[:, self.length : end] = new
        return Layout(*(f[:, :end] for f in self.layout._fields()))

    def prepare(self, layout: Layout) -> int:
        """Allocate (or grow) the buffers for a call of `layout`'s tokens; returns the end slot (host)."""
        b, n = layout.positions.shape
        end = self.length + n
        if self.layout is None or end > self.layout.positions.shape[1]:
            self._grow(b, max(end, self.capacity), layout)
        if self.static and self.start is None:
            self.start = torch.full((), self.length, dtype=torch.long, device=layout.positions.device)
        return end

    def advance(self, n_commit: int) -> None:
        """Keep a call's first n_commit tokens."""
        self.length += n_commit
        if self.start is not None and n_commit:
            self.start.add_(n_commit)  # in place: no read-back, the same tensor every call

    def _grow(self, batch: int, capacity: int, like: Layout) -> None:
        old = self.layout
        fields = [torch.zeros(batch, capacity, dtype=f.dtype, device=f.device) for f in like._fields()]
        if old is not None:
            for buffer, f in zip(fields, old._fields()):
                buffer[:, : self.length] = f[:, : self.length]
        self.layout = Layout(*fields)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                grown = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
                grown[:, :, : self.length] = t[:, :, : self.length]
                store[i] = grown
        self._mark_static()

    def _mark_static(self) -> None:
        """Static mode: a compiled call writes these buffers in place; a CUDA graph may keep their
        addresses (not guarded: a new buffer re-records a graph, it never recompiles)."""
        if self.static:
            for t in (*self.layout._fields(), *self.keys, *self.values):
                torch._dynamo.mark_static_address(t, guard=False)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a call's keys and values (B, H, n, D) at slots length..; the keys and values to attend to."""
        capacity = self.layout.positions.shape[1]
        if layer == len(self.keys):
            self.keys.append(k.new_zeros(*k.shape[:2], capacity, k.shape[3]))
            self.values.append(v.new_zeros(*v.shape[:2], capacity, v.shape[3]))
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A cache holding only the given batch rows (for dropping finished sequences)."""
        layout = None if self.layout is None else Layout(*(f[rows] for f in self.layout._fields()))
        start = None if self.start is None else self.start.clone()
        cache = KVCache(self.capacity, self.static, [k[rows] for k in self.keys], [v[rows] for v in self.values], layout,
                        self.length, start)
        if layout is not None:
            cache._mark_static()
        return cache


class StaticSlots(NamedTuple):
    """A static-shape call's view of a `KVCache`: its layer buffers and the slots `index` (n,) where
    this call's keys and values go. `attend` writes them with `index_copy_` and returns the whole
    buffers (the mask hides the unwritten slots)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    index: torch.Tensor
    capacity: int

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.keys) or self.keys[layer].dtype != k.dtype:  # the first call (eager) allocates
            for store in (self.keys, self.values):
                buffer = k.new_zeros(*k.shape[:2], self.capacity, k.shape[3])
                torch._dynamo.mark_static_address(buffer, guard=False)
                if layer == len(store):
                    store.append(buffer)
                else:  # a reused buffer of another dtype (autocast on or off since)
                    store[layer] = buffer
        self.keys[layer].index_copy_(2, self.index, k)
        self.values[layer].index_copy_(2, self.index, v)
        return self.keys[layer], self.values[layer]


# The last static cache of each model, whose buffers the next one of the same (batch, capacity) reuses.
_STATIC_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reused_static_cache(owner: nn.Module, batch: int, capacity: int) -> KVCache:
    """An empty static `KVCache` that reuses the buffers of `owner`'s previous one when it had the same
    batch and capacity (and device). A CUDA graph keeps the addresses of the buffers it writes: new
    buffers in every generation would record every graph again (and pile the recordings up). Stale
    slots are never seen (each call masks the slots at or after start + n). One generation at a time
    per model; the buffers stay allocated while the model lives."""
    previous = _STATIC_CACHES.get(owner)
    cache = KVCache(capacity, static=True)
    device = next(owner.parameters()).device
    if (previous is not None and previous.layout is not None and previous.layout.positions.shape == (batch, capacity)
            and previous.layout.positions.device == device):
        cache.keys, cache.values, cache.layout = previous.keys, previous.values, previous.layout
    _STATIC_CACHES[owner] = cache
    return cache


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process. Called eagerly it runs an unfused fallback:
    measured on an H200 (paper-size model, batch 8, L = 1024, bf16), 0.660 s per training step
    eager against 0.113 s compiled (13 s to compile)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@dataclass
class RowInvariance:
    """The row-invariant mode's settings and what it keeps across calls (`DiT.row_invariant`): the chunk of query
    rows, the gathered keys and values (`InvariantKeys.gather`), allocated once for the mode's calls, the last call's
    keys' order (`keys_of`), and a time-unconditional model's conditioning row and adaLN outputs (`ConstantCondition`:
    functions of the weights alone, which the mode's calls do not change)."""

    query_rows: int
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    condition: torch.Tensor | None = None
    adaln_outputs: dict[nn.Module, torch.Tensor] = field(default_factory=dict)
    last: tuple[torch.Tensor, "InvariantKeys"] | None = None  # the previous call's mask and its keys' order

    def keys_of(self, mask: torch.Tensor) -> "InvariantKeys":
        """`InvariantKeys.of(mask)`, reused while the mask stays the same: a sampler's steps within a block share
        it (the same prefix and block), and the order is a function of the mask alone."""
        if self.last is not None and self.last[0].shape == mask.shape and torch.equal(self.last[0], mask):
            return self.last[1]
        keys = InvariantKeys.of(mask, self)
        self.last = (mask, keys)
        return keys


@dataclass
class InvariantKeys:
    """A cached call's keys as `row_invariant_attention` reads them: the order once for every layer (and for the
    following calls with the same mask, `RowInvariance.keys_of`), the keys and values gathered per layer.

    `order` (B, span) puts each row's keys in slot order, those its queries see first (a row of a batch sits behind
    padding it lacks alone), then those only a query that sees nothing else sees (itself: a padding query, or a lone
    token), then any others; `spans` is each row's count of the first two groups in whole chunks of
    `INVARIANT_KEY_ROWS` (what the batch would be alone), `span` the largest. `allowed` (B, 1, n, span) is the mask
    in that order."""

    order: torch.Tensor
    allowed: torch.Tensor
    spans: list[int]
    mode: RowInvariance
    indices: dict[tuple[int, int, bool], torch.Tensor] = field(default_factory=dict)  # `gather`'s, per (heads, slots, by_span)

    @property
    def span(self) -> int:
        return self.order.shape[1]

    @classmethod
    def of(cls, mask: torch.Tensor, mode: RowInvariance) -> "InvariantKeys":
        b, _, n, s = mask.shape
        width = INVARIANT_KEY_ROWS
        only_itself = mask.sum(-1, keepdim=True) == 1
        seen = (mask & ~only_itself).any(dim=2)[:, 0]  # (B, S)
        lone = (mask & only_itself).any(dim=2)[:, 0] & ~seen
        rank = 2 - 2 * seen.to(torch.int8) - lone.to(torch.int8)
        order = torch.argsort(rank, dim=-1, stable=True)
        spans = [max(1, -(-int(c) // width)) * width for c in (seen | lone).sum(-1).tolist()]  # the call's one read-back
        span = max(spans)
        order = order[:, :span] if span <= s else torch.cat(
            [order, torch.arange(s, span, device=order.device).expand(b, -1)], dim=1)  # past S: any slot (`gather`)
        allowed = mask.gather(3, order.clamp(max=s - 1)[:, None, None, :].expand(b, 1, n, span))
        allowed[..., s:] = False
        return cls(order, allowed, spans, mode)

    @functools.cached_property
    def chunk_bias(self) -> torch.Tensor:
        """(B, 1, chunks, n', INVARIANT_KEY_ROWS): `allowed` as 0 / -inf in chunks of keys, the queries padded to whole
        chunks of `mode.query_rows` (padding queries see every key: finite)."""
        b, _, n, span = self.allowed.shape
        rows = self.mode.query_rows
        bias = torch.zeros(b, 1, -(-n // rows) * rows, span, device=self.allowed.device)
        bias[:, :, :n].masked_fill_(~self.allowed, -torch.inf)
        return bias.view(b, 1, -1, span // INVARIANT_KEY_ROWS, INVARIANT_KEY_ROWS).transpose(2, 3).contiguous()

    @functools.cached_property
    def groups(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """The batch's rows by their span: (first row, end row, span, bias (rows, 1, n, span) as 0 / -inf), the
        rows in `gather`'s row order (`row_order`: by span, so a group is a slice)."""
        bias = torch.zeros(self.allowed.shape, device=self.allowed.device).masked_fill_(~self.allowed, -torch.inf)
        if self.row_order is not None:
            bias = bias[self.row_order]
        spans, groups, start = sorted(self.spans), [], 0
        for span in dict.fromkeys(spans):
            end = start + spans.count(span)
            groups.append((start, end, span, bias[start:end, :, :, :span].contiguous()))
            start = end
        return groups

    @functools.cached_property
    def row_order(self) -> torch.Tensor | None:
        """The rows sorted by span (stable), or None where they already are."""
        if self.spans == sorted(self.spans):
            return None
        return torch.tensor(sorted(range(len(self.spans)), key=self.spans.__getitem__), device=self.order.device)

    @functools.cached_property
    def rows_back(self) -> torch.Tensor | None:
        """`row_order`'s inverse: the batch's order from the sorted one."""
        return None if self.row_order is None else torch.argsort(self.row_order)

    def gather(self, t: torch.Tensor, name: str, ones: bool = False, by_span: bool = False) -> torch.Tensor:
        """Keys or values (B, H, S, D) in the rows' order, (B H span / chunk, chunk, D): one `index_select` of
        D-vectors from the cache's buffer that `t` is a view of (`torch.gather` on the strided view measured ~2x
        slower at batch 8). Past S it picks written slots of the buffer: a key no query sees gets weight 0 exactly, and its value is
        finite (padding tokens attend to themselves; other slots hold keys or the buffer's zeros), so it adds 0.
        `ones`: a column of ones after the D (..., D + 1), so that one product gives the weighted values and the sum
        of the weights. `by_span`: the rows in `row_order`."""
        b, h, s, d = t.shape
        if t.stride(3) != 1 or t.stride(2) != d or t.stride(0) != h * t.stride(1):  # not a view of a (B, H, slots, D)
            t = t.contiguous()
        slots = t.stride(1) // d
        index = self.indices.get((h, slots, by_span))
        if index is None:
            rows, order = torch.arange(b, device=t.device), self.order
            if by_span and self.row_order is not None:
                rows, order = self.row_order, order[self.row_order]
            base = (rows.view(b, 1, 1) * h + torch.arange(h, device=t.device).view(1, h, 1)) * slots
            index = self.indices[h, slots, by_span] = (base + order.clamp(max=slots - 1)[:, None, :]).view(-1)
        scratch, width = self.mode.scratch, d + ones
        out = scratch.get(name)
        if out is None or out.shape != (b * h * self.span, width) or out.dtype != t.dtype:
            out = scratch[name] = t.new_ones(b * h * self.span, width)  # (index_select writes the first D columns)
        torch.index_select(t.as_strided((b * h * slots, d), (d, 1)), 0, index, out=out[:, :d])
        return out.view(-1, INVARIANT_KEY_ROWS, width)


# The CPU's flash attention kernel cuts a call's queries in blocks of 32 when it has fewer than 192 (of 64 or 256
# above): `per_span_attention` passes at most this many (a multiple of 32 below 192) per call
FLASH_QUERY_CALL = 160


def row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: InvariantKeys) -> torch.Tensor:
    """SDPA (B, H, n, D) against keys (B, H, S, D) so that a row's result does not depend on the batch: on a CPU in
    float32 `per_span_attention`; otherwise (reduced precision, whose CPU kernel packs by the batch's size; a device
    that `INVARIANT_MATRIX_GROUP` names) `chunked_attention`."""
    if q.device.type == "cpu" and q.dtype == torch.float32 and "cpu" not in INVARIANT_MATRIX_GROUP:
        return per_span_attention(q, k, v, keys)
    return chunked_attention(q, k, v, keys)


def per_span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: InvariantKeys) -> torch.Tensor:
    """The CPU's SDPA kernel, given per row exactly what it would get alone: the rows grouped by their span (the keys
    they would have alone, in whole chunks of `INVARIANT_KEY_ROWS`), each group's keys gathered in the row's order
    and cut at its span, so a row's keys, their count and their mask are those of the row alone. The kernel computes
    each (row, head, block of 32 queries) on one thread from that unit's data and shapes alone (query blocks of 32
    in calls of at most `FLASH_QUERY_CALL` queries: a row's left padding is whole 32-token buckets, so the blocks line
    up with the row's alone)."""
    b, h, n, d = q.shape
    kt = keys.gather(k, "keys", by_span=True).view(b, h, keys.span, d)
    vt = keys.gather(v, "values", by_span=True).view(b, h, keys.span, d)
    if keys.row_order is not None:
        q = q.index_select(0, keys.row_order)
    groups = []
    for first, end, span, bias in keys.groups:
        calls = [F.scaled_dot_product_attention(q[first:end, :, start : start + FLASH_QUERY_CALL], kt[first:end, :, :span],
                                                vt[first:end, :, :span], attn_mask=bias[:, :, start : start + FLASH_QUERY_CALL])
                 for start in range(0, n, FLASH_QUERY_CALL)]
        groups.append(calls[0] if len(calls) == 1 else torch.cat(calls, dim=2))
    y = groups[0] if len(groups) == 1 else torch.cat(groups)
    return y if keys.rows_back is None else y.index_select(0, keys.rows_back)


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: InvariantKeys) -> torch.Tensor:
    """SDPA (B, H, n, D) against keys (B, H, S, D) so that a row's result does not depend on the batch, from
    fixed-shape products.

    The keys in `keys`' order, in chunks of `INVARIANT_KEY_ROWS`; the queries in chunks of `keys.mode.query_rows`. Every product
    is a batch of fixed-shape (rows x D) x (D x chunk) and (rows x chunk) x (chunk x (D + 1)) matrices (through
    `invariant_bmm`; the values' extra column of ones gives a chunk's sums of weights in the same product); the softmax's maximum runs over all chunks
    (exact in any order), the sums and the weighted values are added over the chunks one by one in chunk order, and
    divided last. So the chunks past a row's own
    keys, which a batch adds, change nothing: their weights are exactly 0 (a key no query of the row sees), their
    sums and products exactly 0, and adding 0 is exact."""
    b, h, n, d = q.shape
    pairs, rows, width, chunks = b * h, keys.mode.query_rows, INVARIANT_KEY_ROWS, keys.chunk_bias.shape[2]
    kt = keys.gather(k, "keys").transpose(1, 2)  # (pairs chunks, D, width)
    # the values with a column of ones: a chunk's sum of weights comes from the same product as its weighted values
    # (a product, not a sum kernel: a GPU's may reduce a row by the row count)
    vs = keys.gather(v, "values", ones=True)
    padded = keys.chunk_bias.shape[3]
    q = F.pad(q * (1.0 / math.sqrt(d)), (0, 0, 0, padded - n))
    out = []
    for start in range(0, padded, rows):
        chunk = q[:, :, None, start : start + rows].expand(b, h, chunks, rows, d).reshape(pairs * chunks, rows, d)
        scores = invariant_bmm(chunk, kt).view(b, h, chunks, rows, width).add_(keys.chunk_bias[:, :, :, start : start + rows])
        weights = scores.sub_(scores.amax(dim=(2, 4), keepdim=True)).exp_().view(pairs * chunks, rows, width)
        both = invariant_bmm(weights, vs).view(b, h, chunks, rows, d + 1)  # weighted values, sum of weights
        summed = both[:, :, 0]
        for c in range(1, chunks):  # in chunk order, one add each
            summed = summed + both[:, :, c]
        out.append(summed[..., :d] / summed[..., d:])
    return (out[0] if len(out) == 1 else torch.cat(out, dim=2))[:, :, :n]


class Attention(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.n_heads, d = cfg.shape.n_heads, cfg.shape.d_model
        self.qkv = Linear(d, 3 * d, bias=False)
        self.out = Linear(d, d, bias=False)

    def forward(self, x, rotary, mask, cache: KVCache | None, layer: int, n_commit: int):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, rotary), rotate(k, rotary)
        if cache is not None:
            k, v = cache.attend(layer, k, v)
        if isinstance(mask, InvariantKeys):  # a cached call in the row-invariant mode (DiT.row_invariant)
            y = row_invariant_attention(q, k, v, mask)
        elif isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = compiled_flex_attention()(q, k, v, block_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


@dataclass
class ConstantCondition:
    """The adaLN input of a time-unconditional model in the row-invariant mode: one row (t = 0) for every row of
    every call, so each adaLN layer's output for it is computed once for the mode (`outputs`, kept by the mode)."""

    row: torch.Tensor  # (1, cond_dim)
    batch: int
    outputs: dict[nn.Module, torch.Tensor]

    def through(self, layer: nn.Module) -> torch.Tensor:
        out = self.outputs.get(layer)
        if out is None:
            out = self.outputs[layer] = layer(self.row)
        return out.expand(self.batch, -1)


def adaln(layer: nn.Module, cond: "torch.Tensor | ConstantCondition") -> torch.Tensor:
    """The adaLN layer's output (B, width) for the conditioning (B, cond_dim)."""
    return cond.through(layer) if isinstance(cond, ConstantCondition) else layer(cond)


class DiTBlock(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        d = cfg.shape.d_model
        self.norm1 = LayerNorm(d)
        self.attn = Attention(cfg)
        self.norm2 = LayerNorm(d)
        self.mlp = nn.Sequential(Linear(d, 4 * d), nn.GELU(approximate="tanh"), Linear(4 * d, d))
        if cfg.adaln:
            self.adaLN = Linear(cfg.shape.cond_dim, 6 * d)
            nn.init.zeros_(self.adaLN.weight)
            nn.init.zeros_(self.adaLN.bias)
        self.dropout = nn.Dropout(cfg.shape.dropout)

    def forward(self, x, cond, rotary, mask, cache, layer, n_commit):
        if cond is None:  # no adaLN: plain pre-norm block (gates 1, no shift or scale)
            x = x + self.dropout(self.attn(self.norm1(x), rotary, mask, cache, layer, n_commit))
            return x + self.dropout(self.mlp(self.norm2(x)))
        shift1, scale1, gate1, shift2, scale2, gate2 = adaln(self.adaLN, cond)[:, None].chunk(6, dim=-1)
        h = self.attn(modulate(self.norm1(x), shift1, scale1), rotary, mask, cache, layer, n_commit)
        x = x + gate1 * self.dropout(h)
        h = self.mlp(modulate(self.norm2(x), shift2, scale2))
        return x + gate2 * self.dropout(h)


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of t followed by an MLP; BlockGen always feeds t = 0."""

    def __init__(self, cond_dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(Linear(freq_dim, cond_dim), nn.SiLU(), Linear(cond_dim, cond_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class FinalLayer(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.norm = LayerNorm(cfg.shape.d_model)
        self.linear = Linear(cfg.shape.d_model, cfg.vocab_size)
        layers = [self.linear]
        if cfg.adaln:
            self.adaLN = Linear(cfg.shape.cond_dim, 2 * cfg.shape.d_model)
            layers.append(self.adaLN)
        for layer in layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        if cond is None:
            return self.linear(self.norm(x))
        shift, scale = adaln(self.adaLN, cond)[:, None].chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shape = cfg.shape
        self.embed = nn.Embedding(cfg.vocab_size, shape.d_model)  # untied from the output layer
        if cfg.adaln:
            self.time = TimestepEmbedder(shape.cond_dim)
        self.rotary = Rotary(shape.d_model // shape.n_heads, cfg.max_len)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(shape.n_layers))
        self.final = FinalLayer(cfg)
        self.dropout = nn.Dropout(shape.dropout)
        self._invariance: RowInvariance | None = None  # set inside `row_invariant`

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def row_invariant_active(self) -> bool:
        return self._invariance is not None

    @contextlib.contextmanager
    def row_invariant(self, rows: int = INVARIANT_ROWS, query_rows: int = INVARIANT_QUERY_ROWS):
        """Within it, a batch row's outputs are those of the row alone, bit for bit, when its tensors are laid out as
        they would be alone (same width and padding: the callers' buckets, whole multiples of 32 tokens): every linear
        layer runs on fixed-shape chunks of `rows` token rows (`fixed_shape_linear`) and the adaLN conditioning is
        computed per row (or once for the mode: it is the same for every row and call of a time-unconditional model,
        `ConstantCondition`). Attention and normalisation compute each row (and head) on its own, and elementwise
        kernels round an element the same way wherever it sits except in the vector remainder at a tensor's end, which
        a (rows x 32k tokens x width) tensor does not have. A cached call's attention is `row_invariant_attention`
        (the chunked products take chunks of `query_rows` queries). For inference: what the mode keeps across calls
        is computed from the weights as they are when it is entered."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.rows, m.weight_t = rows, m.weight.detach().t().contiguous()
        self._invariance = RowInvariance(query_rows)
        try:
            yield self
        finally:
            self._invariance = None
            for m in linears:
                m.rows, m.weight_t = None, None

    def conditioning(self, batch: int, device, sigma: torch.Tensor | None = None) -> torch.Tensor | ConstantCondition | None:
        """The adaLN input c (B, cond_dim), or None without adaLN (a `ConstantCondition` in the row-invariant mode).

        Time-unconditional models embed t = 0 (a learned constant; the authors' sigma = 0 is the same
        input). With `time_conditioning`, `sigma` (B,) = -log alpha_t is embedded instead.
        """
        if not self.cfg.adaln:
            return None
        if sigma is None or not self.cfg.time_conditioning:
            if self._invariance is not None:  # one row for all rows and calls, computed once for the mode
                mode = self._invariance
                if mode.condition is None:
                    mode.condition = self._embed_time(torch.zeros(1, device=device))
                return ConstantCondition(mode.condition, batch, mode.adaln_outputs)
            sigma = torch.zeros(batch, device=device)
        if self._invariance is not None:
            # row by row: an elementwise kernel computes the last elements of a (B, cond_dim) tensor (its vector
            # remainder) another way than the rest, so a row's place in the batch would change its rounding
            return torch.cat([self._embed_time(sigma[i : i + 1]) for i in range(batch)])
        return self._embed_time(sigma)

    def _embed_time(self, sigma: torch.Tensor) -> torch.Tensor:
        cond = self.time(sigma)
        return F.silu(cond) if self.cfg.cond_silu else cond

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, mask, cache: KVCache | None, n_commit: int, n_out: int,
             sigma: torch.Tensor | None = None):
        cond = self.conditioning(tokens.shape[0], tokens.device, sigma)
        if cache is not None and self._invariance is not None:  # the keys' order, once for every layer
            mask = self._invariance.keys_of(mask)
        x = self.dropout(self.embed(tokens))
        rotary = self.rotary.tables(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, cond, rotary, mask, cache, i, n_commit)
        return self.final(x[:, x.shape[1] - n_out :], cond).float()

    def forward_train(
        self, x0: torch.Tensor, xt: torch.Tensor, block_size: int, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of the noisy half of `[x0 ; xt]` (B, L, V) under block size `block_size`.

        `valid` (B, L) marks real tokens: padding (False) is invisible to every real token in both
        streams, so rows of different lengths share a batch without their padding changing any
        logit (the last block may be partial). It uses the dense SDPA mask, one per batch.
        """
        if self.cfg.architecture == "ar":
            if block_size != 1:
                raise ValueError(f"the plain AR network has block size 1 only, got {block_size}")
            return self.next_token_logits(x0, valid)
        if self.cfg.architecture == "full_sequence":
            return self.forward_full(xt, None, valid)  # time-conditioned callers pass sigma to forward_full
        seq_len = x0.shape[1]
        layout = training_layout(seq_len, block_size, x0.device)
        if valid is not None:
            layout = replace(layout, valid=torch.cat([valid, valid], dim=1))
            mask = dense_mask(layout, layout, self.cfg.causal_clean)
        elif self.cfg.attention == "flex":
            mask = training_block_mask(seq_len, block_size, self.cfg.causal_clean, str(x0.device))
        else:
            mask = training_mask(seq_len, block_size, self.cfg.causal_clean, str(x0.device))
        tokens = torch.cat([x0, xt], dim=1)
        return self._run(tokens, layout.positions, mask, None, 0, seq_len)  # (1, 2L) positions broadcast

    def forward_full(self, xt: torch.Tensor, sigma: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence diffusion: logits (B, L, V) of one bidirectional pass over the noisy sequence,
        positions 0..L-1 (padding, `valid` False, invisible). `sigma` (B,): see `conditioning`."""
        b, n = xt.shape
        positions = torch.arange(n, device=xt.device)[None]
        if valid is None:
            mask = torch.ones(1, 1, n, n, dtype=torch.bool, device=xt.device)
        else:
            flags = torch.ones(b, n, dtype=torch.bool, device=xt.device)
            layout = Layout(positions.expand(b, n), torch.zeros(b, n, dtype=torch.long, device=xt.device), flags, valid)
            mask = dense_mask(layout, layout, True)
        return self._run(xt, positions, mask, None, 0, n, sigma)

    def forward_ar(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The plain causal transformer: logits (B, L, V) where row i predicts x[:, i + 1]."""
        b, n = x.shape
        positions = torch.arange(n, device=x.device)[None].expand(b, n)
        valid = torch.ones(b, n, dtype=torch.bool, device=x.device) if valid is None else valid
        layout = Layout(positions, positions, torch.zeros_like(valid), valid)
        return self._run(x, positions, dense_mask(layout, layout, True), None, 0, n)

    def next_token_logits(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """`forward_ar` aligned as BlockGen's block-size-1 logits: row i predicts x[:, i].

        Row 0 has nothing to condition on in a plain AR model: the first token is given (log-prob 0),
        as the authors' AR scores x[1:] from x[:-1].
        """
        raw = self.forward_ar(x, valid)
        first = torch.full_like(raw[:, :1], -torch.inf).scatter_(-1, x[:, :1, None], 0.0)
        return torch.cat([first, raw[:, :-1]], dim=1)

    def forward_cached(
        self,
        tokens: torch.Tensor,
        layout: Layout,
        cache: KVCache,
        n_commit: int = 0,
        sigma: torch.Tensor | None = None,
        n_noisy: int | None = None,
        compiled: bool = False,
    ) -> torch.Tensor:
        """Run new tokens against a KV cache; returns logits of the noisy tokens (which come last).

        `tokens` is `[clean (n_clean) ; noisy (n_noisy)]`. The first `n_commit` clean tokens are
        appended to the cache; the other clean tokens (e.g. an ARPC proposal) are seen by this call
        only. Uses SDPA with a dense mask: at sampling time the query count is one block. The
        sampler passes `n_noisy` (it built the layout); without it it is read from the layout, a
        host read that a GPU waits for. A static cache runs `forward_static`; `compiled=True` runs it
        through `compiled_forward_static` (once the cache's layer buffers exist: the first call
        allocates them). The sampler keeps its first call, the prompt's, eager: a shape seen once.
        """
        layout = layout.expand(tokens.shape[0])
        if n_noisy is None:
            n_noisy = int(layout.noisy[0].sum())
        if self.cfg.architecture == "ar":
            # The plain AR network never sees the placeholder: the noisy token at position p is
            # predicted by the output of the call's last clean token (position p - 1).
            n_clean = tokens.shape[1] - n_noisy
            if n_noisy != 1 or n_clean < 1:
                raise ValueError(f"the plain AR network predicts one token after at least one clean token per call; "
                                 f"got {n_clean} clean and {n_noisy} noisy tokens")
            layout = Layout(*(f[:, :n_clean] for f in layout._fields()))
            tokens, n_noisy = tokens[:, :n_clean], 1
        if cache.static:
            cache.prepare(layout)
            run = self.forward_static
            if compiled and len(cache.keys) == len(self.blocks):
                run = functools.partial(compiled_forward_static(tokens.device.type), self)
            logits = run(tokens, layout, cache.start, cache.layout, cache.keys, cache.values, n_noisy, sigma)
            cache.advance(n_commit)
            return logits
        if compiled:
            raise ValueError("compiled=True needs a static KVCache (KVCache(capacity, static=True))")
        start = cache.length
        keys = cache.reserve(layout)
        mask = dense_mask(layout, keys, self.cfg.causal_clean or self.cfg.architecture == "ar", query_offset=start)
        logits = self._run(tokens, layout.positions, mask, cache, n_commit, n_noisy, sigma)
        cache.advance(n_commit)
        return logits

    def forward_static(
        self,
        tokens: torch.Tensor,
        layout: Layout,
        start: torch.Tensor,
        slots: Layout,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        n_noisy: int,
        sigma: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One call against a static cache, a function of tensors only (what `torch.compile` captures):
        writes the call's layout, keys and values at slots start.. (`slots`: the cache's (B, capacity)
        layout buffers; `keys`, `values`: its layer buffers) and attends to every slot, those at or
        after start + n masked out. Its shapes depend on (batch, query tokens, capacity) alone."""
        n, capacity = tokens.shape[1], slots.positions.shape[1]
        index = start + torch.arange(n, device=tokens.device)
        for buffer, new in zip(slots._fields(), layout._fields()):
            buffer.index_copy_(1, index, new)
        written = torch.arange(capacity, device=tokens.device) < start + n
        visible = Layout(slots.positions, slots.block_ids, slots.noisy, slots.valid & written)
        mask = dense_mask(layout, visible, self.cfg.causal_clean or self.cfg.architecture == "ar", query_offset=start)
        return self._run(tokens, layout.positions, mask, StaticSlots(keys, values, index, capacity), 0, n_noisy, sigma)


def fit_inductor_to_this_cpu() -> None:
    """Under ``ATEN_CPU_CAPABILITY=default`` (ATen's kernels without SIMD) torch 2.13's inductor still writes vectorised
    C++ (``at::vec``) that the scalar build does not declare, and every CPU compile fails with a C++ error; scalar code
    (``cpp.simdlen = 1``) compiles and runs. Other capabilities keep inductor's own choice."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        from torch._inductor import config as inductor_config

        inductor_config.cpp.simdlen = 1


@functools.cache
def compiled_forward_static(device_type: str):
    """`DiT.forward_static` under `torch.compile`, once per process and device type. Dynamo keeps one
    graph per call shape: (batch, query tokens, capacity), sigma or not, and the model's own shape
    (models of one shape share graphs: their weights are inputs). CUDA: mode "reduce-overhead", each
    call replayed as a CUDA graph; elsewhere inductor's default mode (a CPU runs the same compiled
    program, without graphs). Static shapes (`dynamic=False`): a new batch size or capacity compiles
    anew, up to `RECOMPILE_LIMIT` graphs (then dynamo runs it eagerly, with a warning)."""
    mode = "reduce-overhead" if device_type == "cuda" else None
    if device_type == "cpu":
        fit_inductor_to_this_cpu()
    compiled = torch.compile(DiT.forward_static, dynamic=False, mode=mode)

    def call(*args, **kwargs):
        if device_type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs may be overwritten
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return call


# Graphs `compiled_forward_static` may hold before dynamo falls back to eager (its default is 8):
# a few call kinds per (model, block size, batch size, capacity).
RECOMPILE_LIMIT = 64
