"""FLOP formulas for what a strategy actually computes.

FLOPs are 2 x multiply-adds of matrix products (linear layers, attention scores and attention-weighted values).
Element-wise work (layer norms, activations, softmax, cosine similarities, gathers) is not counted: it is a few
percent of a MAR block and the same order for every strategy. Components are ``encoder``, ``decoder`` and ``head``;
kinds are ``linear`` and ``attention``.
"""
from __future__ import annotations

__all__ = ["attention_flops", "block_linear_flops", "head_embed_flops", "head_eval_flops", "linear_flops",
           "stack_dims"]


def linear_flops(rows: int, d_in: int, d_out: int) -> int:
    """FLOPs of a linear layer applied to ``rows`` vectors."""
    return 2 * rows * d_in * d_out


def block_linear_flops(rows: int, width: int, hidden: int, mlp: bool = True) -> int:
    """Linear FLOPs of one ViT block for ``rows`` query rows: qkv, proj, and the MLP when ``mlp``."""
    attn = linear_flops(rows, width, 3 * width) + linear_flops(rows, width, width)
    return attn + (linear_flops(rows, width, hidden) + linear_flops(rows, hidden, width) if mlp else 0)


def attention_flops(n_queries: int, n_keys: int, width: int) -> int:
    """FLOPs of scores (q k^T) and weighted values (p v) summed over heads (``width`` = heads x head_dim)."""
    return 4 * n_queries * n_keys * width


def stack_dims(model, stack: str) -> tuple[int, int]:
    """(width, MLP hidden size) of the ``encoder`` or ``decoder`` blocks of a MAR model."""
    blocks = model.encoder_blocks if stack == "encoder" else model.decoder_blocks
    mlp = blocks[0].mlp
    return mlp.fc1.in_features, mlp.fc1.out_features


def head_eval_flops(net, rows: int, mlp_blocks: int | None = None, ada_blocks: int | None = None,
                    time_embed: bool = True, cond_embed: bool = True) -> int:
    """FLOPs of one evaluation of the diffusion MLP on ``rows`` inputs.

    ``mlp_blocks`` / ``ada_blocks`` are the residual blocks whose MLP / AdaLN modulation ran (default: all);
    ``time_embed`` / ``cond_embed``: whether the timestep / condition embeddings were computed in this evaluation
    (False when served from a cache, see :func:`head_embed_flops`).
    """
    w, c = net.model_channels, net.in_channels
    depth = net.num_res_blocks
    mlp_blocks = depth if mlp_blocks is None else mlp_blocks
    ada_blocks = depth if ada_blocks is None else ada_blocks
    per_row = (c * w                                         # input_proj
               + ada_blocks * 3 * w * w + mlp_blocks * 2 * w * w
               + 2 * w * w + w * net.out_channels)           # final layer
    return 2 * rows * per_row + head_embed_flops(net, rows, time=time_embed, cond=cond_embed)


def head_embed_flops(net, rows: int, time: bool = True, cond: bool = True) -> int:
    """FLOPs of the head's timestep embedding MLP (``time``) and condition projection (``cond``) on ``rows``."""
    w = net.model_channels
    per_row = (net.time_embed.frequency_embedding_size * w + w * w if time else 0) \
        + (net.cond_embed.in_features * w if cond else 0)
    return 2 * rows * per_row
