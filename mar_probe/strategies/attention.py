"""Cache-aware attention: active queries attend to fresh and cached keys/values without concatenating them.

Softmax attention over a key set split into two disjoint parts A (active, fresh) and C (cached) is computed as two
partial attentions, each normalised on its own and returned with its log-sum-exp, then merged exactly:

    lse = logaddexp(lse_A, lse_C)
    out = exp(lse_A - lse) * out_A + exp(lse_C - lse) * out_C

which is the safe online softmax of FlashAttention / MARché: no score is exponentiated without subtracting a maximum,
so the result equals softmax attention over the union of the two key sets up to float rounding. On the CPU each
partial runs in PyTorch's fused flash-attention kernel, which returns the log-sum-exp with the output.
"""
from __future__ import annotations

import torch


# PyTorch's fused CPU flash-attention kernel returns the log-sum-exp beside the output (one multi-threaded pass,
# safe online softmax); elsewhere the explicit form below is used.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Softmax attention over one key set, with its log-sum-exp.

    Parameters
    ----------
    q : Tensor [B, H, Nq, Dh]
    k, v : Tensor [B, H, Nk, Dh]
    scale : float
        Score scale (``Dh ** -0.5`` for MAR).

    Returns
    -------
    out : Tensor [B, H, Nq, Dh]
        ``softmax(q k^T * scale) v`` normalised over this key set only.
    lse : Tensor [B, H, Nq, 1]
        ``logsumexp(q k^T * scale)`` over the keys (``-inf`` when there are none).
    """
    if k.shape[-2] == 0:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), q.new_full(q.shape[:-1] + (1,), float("-inf"))
    if _FUSED_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32 and not q.requires_grad:
        out, lse = _FUSED_CPU(q, k, v, 0.0, False, attn_mask=None, scale=scale)   # lse [B, H, Nq]
        return out, lse.unsqueeze(-1)
    scores = (q @ k.transpose(-2, -1)) * scale              # [B, H, Nq, Nk]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)     # [B, H, Nq, 1]
    return torch.exp(scores - lse) @ v, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_c: torch.Tensor, lse_c: torch.Tensor) -> torch.Tensor:
    """Merge two partial attentions over disjoint key sets into attention over their union."""
    lse = torch.logaddexp(lse_a, lse_c)                     # [B, H, Nq, 1]
    w_a = torch.exp(lse_a - lse)
    return w_a * out_a + torch.exp(lse_c - lse) * out_c


def cache_aware_attention(q: torch.Tensor, k_active: torch.Tensor, v_active: torch.Tensor,
                          k_cached: torch.Tensor | None, v_cached: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of active queries over active K/V and cached K/V, merged with log-sum-exp.

    Parameters
    ----------
    q : Tensor [B, H, Na, Dh]
        Queries of the active rows.
    k_active, v_active : Tensor [B, H, Na, Dh]
        Fresh keys and values of the active rows.
    k_cached, v_cached : Tensor [B, H, Nc, Dh] or None
        Keys and values of the other rows, from the cache (None or Nc = 0: no cached rows).
    scale : float

    Returns
    -------
    Tensor [B, H, Na, Dh]
        Equal (up to rounding) to softmax attention over the concatenation of both key sets.
    """
    out_a, lse_a = partial_attention(q, k_active, v_active, scale)
    if k_cached is None or k_cached.shape[-2] == 0:
        return out_a
    out_c, lse_c = partial_attention(q, k_cached, v_cached, scale)
    return merge_partials(out_a, lse_a, out_c, lse_c)
