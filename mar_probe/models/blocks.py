"""Transformer blocks with the parameter names of timm's ViT ``Block`` and TransformerLens-style hook points.

Every ``HookPoint`` is an identity module: a forward hook on it sees (and may replace) the tensor, and with no
hooks it changes nothing. Names: ``attn.hook_q/k/v`` [B, H, N, Dh], ``attn.hook_attn_out`` [B, N, D] (after
``proj``), ``hook_mlp_out`` [B, N, D], ``hook_resid_mid`` and ``hook_resid_post`` [B, N, D].
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


class HookPoint(nn.Module):
    """Identity module marking a tensor that probes may read."""

    def forward(self, x):
        return x


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


AttentionKernel = Literal["sdpa", "explicit"]
ATTENTION_KERNELS: tuple[str, ...] = ("sdpa", "explicit")


class Attention(nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection, split into reusable pieces.

    ``kernel`` picks how :meth:`attend` computes softmax attention: ``"sdpa"`` (the fused kernel, what sampling
    uses, bit-exact with the official code) or ``"explicit"`` (``softmax(q k^T) v`` as three ops). Training
    sets ``"explicit"``: under bf16 autocast on a CPU its matrix products run on the bf16 units, and the
    fused kernel's backward pass was 1.4x slower per iteration for the 12+12 model (issue 14,
    ``benchmarks/results/train_speed.json``).
    """

    def __init__(self, dim: int, num_heads: int, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.attn_drop_p = attn_drop
        self.kernel: AttentionKernel = "sdpa"
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_out = HookPoint()

    def qkv_heads(self, x):
        """x [B, N, D] -> q, k, v each [B, H, N, Dh], passed through their hook points."""
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, B, H, N, Dh]
        return self.hook_q(qkv[0]), self.hook_k(qkv[1]), self.hook_v(qkv[2])

    def attend(self, q, k, v):
        """Softmax attention [B, H, Nq, Dh] x [B, H, Nk, Dh] -> [B, H, Nq, Dh]."""
        p = self.attn_drop_p if self.training else 0.0
        if self.kernel == "explicit":
            return explicit_attention(q, k, v, dropout_p=p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

    def project(self, o):
        """o [B, H, N, Dh] -> [B, N, D] through the output projection."""
        b, h, n, dh = o.shape
        return self.hook_attn_out(self.proj_drop(self.proj(o.transpose(1, 2).reshape(b, n, h * dh))))

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        return self.project(self.attend(q, k, v))


def explicit_attention(q, k, v, scale=None, dropout_p: float = 0.0):
    """softmax(q k^T * scale) v as three ops: the reference for the fused kernel, and the training kernel."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    weights = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)  # [B, H, Nq, Nk]
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def set_attention_kernel(model: nn.Module, kernel: AttentionKernel) -> None:
    """Set the softmax-attention kernel of every :class:`Attention` in ``model``."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {ATTENTION_KERNELS!r}")
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = kernel


class Block(nn.Module):
    """Pre-norm ViT block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, attn_drop, proj_drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), proj_drop)
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x):
        x = self.hook_resid_mid(x + self.attn(self.norm1(x)))
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.norm2(x))))
