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


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, N, D], idx [B, n] -> [B, n, D]."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def scatter_rows(x: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write src [B, n, D] into rows idx [B, n] of x [B, N, D] in place; returns x."""
    return x.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]), src)


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
    """Keys and values of one stack, per layer, indexed by sequence position: [B, H, N, Dh] each."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, length: int):
        """Store k, v [B, H, n, Dh] at positions [B, n] (None: all ``length`` positions in order)."""
        if positions is None:
            if k.shape[2] != length:
                raise ValueError(f"storing all positions needs {length} rows, got {k.shape[2]!r}")
            self.k[layer], self.v[layer] = k.contiguous(), v.contiguous()
            return
        if layer not in self.k:
            shape = k.shape[:2] + (length, k.shape[-1])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        scatter_heads(self.k[layer], positions, k)
        scatter_heads(self.v[layer], positions, v)

    def fetch(self, layer: int, positions: torch.Tensor):
        """Cached (k, v) [B, H, n, Dh] at positions [B, n]."""
        return gather_heads(self.k[layer], positions), gather_heads(self.v[layer], positions)
