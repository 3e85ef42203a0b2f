"""Block runners shared by the caching strategies, and position-indexed K/V caches.

:func:`full_block` runs a MAR :class:`~mar_probe.models.blocks.Block` op for op as ``Block.forward`` (so its output is
bit-identical) while handing out the layer's keys and values; :func:`active_attention` and :func:`block_mlp` run a
block for a subset of rows whose other keys/values come from a cache. All go through the block's hook points, so a
probe sees exactly the rows that were computed (``[B, Nactive, ...]`` on cached layers).
"""
from __future__ import annotations

import torch

from .attention import cache_aware_attention


def full_block(block, x: torch.Tensor):
    """``block(x)`` for x [B, N, D], computed as ``Block.forward``; returns (out [B, N, D], k, v [B, H, N, Dh])."""
    q, k, v = block.attn.qkv_heads(block.norm1(x))
    x = block.hook_resid_mid(x + block.attn.project(block.attn.attend(q, k, v)))
    return block_mlp(block, x), k, v


def block_mlp(block, x: torch.Tensor) -> torch.Tensor:
    """Second half of a block (MLP residual) for the rows in x [B, N, D]."""
    return block.hook_resid_post(x + block.hook_mlp_out(block.mlp(block.norm2(x))))


def active_attention(block, x_act: torch.Tensor, k_cached, v_cached):
    """First half of a block (attention residual) for active rows x_act [B, Na, D].

    Active queries attend to the active rows' fresh K/V and the cached K/V [B, H, Nc, Dh] of the other rows
    (cache-aware attention). Returns (resid_mid [B, Na, D], k, v [B, H, Na, Dh]).
    """
    attn = block.attn
    q, k, v = attn.qkv_heads(block.norm1(x_act))
    o = cache_aware_attention(q, k, v, k_cached, v_cached, attn.scale)     # [B, H, Na, Dh]
    return block.hook_resid_mid(x_act + attn.project(o)), k, v


def flat_rows(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Row indices idx [b, k] into a [B, n, ...] tensor -> indices [b * k] into its [B * n, ...] flattening."""
    return (idx + torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) * n).reshape(-1)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, N, D], idx [b, n] (b <= B: the first b rows) -> [b, n, D].

    One ``index_select`` of whole rows on the flattened tensor: many times faster on the CPU than ``torch.gather``
    with an index expanded over D.
    """
    _, n, d = x.shape
    return x.reshape(-1, d).index_select(0, flat_rows(idx, n)).view(idx.shape[0], idx.shape[1], d)


def scatter_rows(x: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write src [b, n, D] into rows idx [b, n] of x [B, N, D] (b <= B) in place; returns x."""
    if not x.is_contiguous():                                               # a view of the first b rows
        x[:idx.shape[0]].scatter_(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]), src)
        return x
    d = x.shape[-1]
    x.view(-1, d).index_copy_(0, flat_rows(idx, x.shape[1]), src.reshape(-1, d))
    return x


def gather_heads(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t [B, H, N, Dh], idx [b, n] -> [b, H, n, Dh] (b <= B: the first b rows, e.g. the conditional branch)."""
    _, h, _, dh = t.shape
    return torch.gather(t, 2, idx[:, None, :, None].expand(idx.shape[0], h, idx.shape[1], dh))


def scatter_heads(t: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write src [B, H, n, Dh] into positions idx [B, n] of t [B, H, N, Dh] in place; returns t."""
    return t.scatter_(2, idx[:, None, :, None].expand_as(src), src)


def rows_of(mask: torch.Tensor) -> torch.Tensor:
    """Indices [B, n] of the True entries of a bool mask [B, N] holding the same count n in every row."""
    return mask.nonzero(as_tuple=True)[1].reshape(mask.shape[0], -1)


class KVCache:
    """Keys and values of one stack, per layer, indexed by sequence position.

    Stored position-major, [B, N, H, Dh], so that storing and fetching rows are copies of whole rows
    (``index_copy_`` / ``index_select``); ``k[layer]`` and ``v[layer]`` are [B, H, N, Dh] views of the storage.
    """

    def __init__(self):
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    @property
    def k(self) -> dict[int, torch.Tensor]:
        """Cached keys per layer, [B, H, N, Dh] views."""
        return {i: t.transpose(1, 2) for i, t in self._k.items()}

    @property
    def v(self) -> dict[int, torch.Tensor]:
        """Cached values per layer, [B, H, N, Dh] views."""
        return {i: t.transpose(1, 2) for i, t in self._v.items()}

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, length: int):
        """Store k, v [B, H, n, Dh] at positions [B, n] (None: all ``length`` positions in order)."""
        if positions is None:
            if k.shape[2] != length:
                raise ValueError(f"storing all positions needs {length} rows, got {k.shape[2]!r}")
            self._k[layer] = k.transpose(1, 2).contiguous()                  # [B, N, H, Dh]
            self._v[layer] = v.transpose(1, 2).contiguous()
            return
        b, h, _, dh = k.shape
        if layer not in self._k:
            self._k[layer], self._v[layer] = k.new_zeros(b, length, h, dh), v.new_zeros(b, length, h, dh)
        rows = flat_rows(positions, self._k[layer].shape[1])
        for store, src in ((self._k[layer], k), (self._v[layer], v)):
            store.view(-1, h * dh).index_copy_(0, rows, src.transpose(1, 2).reshape(-1, h * dh))

    def fetch(self, layer: int, positions: torch.Tensor):
        """Cached (k, v) [b, H, n, Dh] at positions [b, n] (b <= B: the first b rows)."""
        _, length, h, dh = self._k[layer].shape
        rows, shape = flat_rows(positions, length), (positions.shape[0], positions.shape[1], h, dh)
        return tuple(t.view(-1, h * dh).index_select(0, rows).view(shape).transpose(1, 2)
                     for t in (self._k[layer], self._v[layer]))
