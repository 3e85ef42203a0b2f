"""LazyMAR's condition cache as a part over any token policy's decoder hidden state (issue 18, item 4).

On the token policy's refresh steps (and while ``step < warmup``) both CFG branches are computed and the
difference ``uncond - cond`` of the decoder's last hidden state is stored; on its other steps the policy runs on
the conditional branch only and the unconditional hidden state is ``cond + difference`` (LazyMAR's "condition
cache"; LazyMAR itself computes everything in its first 5 steps, where the CFG residual still moves most).
"""
from __future__ import annotations

import dataclasses

import torch


class ConditionCache:
    """Derives the unconditional branch between refreshes; ``hidden`` wraps the token policy's ``hidden``."""

    def __init__(self, warmup: int = 0):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"condition cache warmup must be an integer >= 0, got {warmup!r}")
        self.warmup = warmup
        self.reset()

    def reset(self) -> None:
        """Forget the cached difference (call at the start of a batch)."""
        self.diff = None                                                     # [B, S+L, D] uncond - cond

    def hidden(self, policy, model, state, timer) -> torch.Tensor:
        """The decoder's last hidden state [B', S+L, D] of both branches, the unconditional one derived when it can."""
        two = len(state.branches) == 2
        if not two or self.diff is None or state.step < self.warmup or policy.is_refresh(state.step):
            x = policy.hidden(model, state, timer)                          # [B', S+L, D]
            if two:
                self.diff = x[state.batch_size:] - x[:state.batch_size]
            return x
        x = policy.hidden(model, cond_only(state), timer)                   # [B, S+L, D]
        plan = state.outputs.plan
        plan.computed, plan.derived = ("cond",), ("uncond",)
        return torch.cat([x, x + self.diff], dim=0)                         # [B', S+L, D]


def cond_only(state):
    """The step state restricted to its conditional branch (the same outputs object, so plans land in the step's)."""
    b = state.batch_size
    return dataclasses.replace(state, branches=("cond",), tokens_in=state.tokens_in[:b], mask_in=state.mask_in[:b],
                               class_embedding=state.class_embedding[:b], enc_positions=state.enc_positions[:b],
                               outputs=state.outputs)
