"""The reference computation of a step: the full model on a step's inputs, every layer's K/V and hidden state.

Shadow mode (:mod:`mar_probe.probe.shadow`) compares what a strategy used against it, and the oracle selection of
``marche`` ranks tokens by their true drift from it. It runs with observers' hooks suspended, block by block as
``Block.forward`` (:func:`~mar_probe.strategies.layers.full_block`), so its values are bit-identical to
:class:`~mar_probe.engine.strategy.FullStrategy`'s on the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hooks import suspended
from .layers import full_block


@dataclass
class StackTrace:
    """One stack of the reference forward. ``positions`` [B', N] are the rows' indices in ``[buffer; tokens]``;
    per layer ``k``/``v`` [B', H, N, Dh] and ``out`` (the block output, resid_post) [B', N, D]."""
    positions: torch.Tensor
    k: list
    v: list
    out: list


@dataclass
class ReferenceTrace:
    """The full model on one step's inputs: both stacks and the head condition ``z`` [B', L, D]."""
    encoder: StackTrace
    decoder: StackTrace
    z: torch.Tensor

    def stack(self, name: str) -> StackTrace:
        return self.encoder if name == "encoder" else self.decoder


def _run_stack(blocks, x: torch.Tensor, positions: torch.Tensor) -> StackTrace:
    trace = StackTrace(positions, [], [], [])
    for block in blocks:
        x, k, v = full_block(block, x)
        trace.k.append(k)
        trace.v.append(v)
        trace.out.append(x)
    return trace


@torch.no_grad()
def reference_trace(model, state) -> ReferenceTrace:
    """Run the full model on ``state``'s inputs (all branches) and keep every layer's K/V and output."""
    with suspended():
        x = model.encoder_input(state.tokens_in, state.mask_in, state.class_embedding)   # [B', Nenc, D]
        enc = _run_stack(model.encoder_blocks, x, state.enc_positions)
        x = model.decoder_input(model.encoder_norm(enc.out[-1]), state.mask_in)          # [B', S+L, D]
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        dec = _run_stack(model.decoder_blocks, x, pos)
        z = model.decoder_output(dec.out[-1])                                           # [B', L, D]
    return ReferenceTrace(enc, dec, z)


def relative_error(used: torch.Tensor, fresh: torch.Tensor, dim=-1) -> torch.Tensor:
    """``|used - fresh| / |fresh|`` (L2 over ``dim``; 0 where both are 0), in float32."""
    used, fresh = used.float(), fresh.float()
    num = (used - fresh).pow(2).sum(dim).sqrt()
    den = fresh.pow(2).sum(dim).sqrt()
    return torch.where(num == 0, torch.zeros_like(num), num / den.clamp_min(torch.finfo(torch.float32).tiny))


def kv_error(k_used, v_used, k_fresh, v_fresh) -> torch.Tensor:
    """Relative error of a row's keys and values together: [B, H, N, Dh] x 4 -> [B, N] (heads concatenated)."""
    used = torch.cat([k_used, v_used], dim=-1).transpose(1, 2).flatten(2)     # [B, N, H*2Dh]
    fresh = torch.cat([k_fresh, v_fresh], dim=-1).transpose(1, 2).flatten(2)
    return relative_error(used, fresh)
