"""Where the rows a hook saw at one step sit on the store's token axis: :class:`StepRows`.

A hook sees a tensor [B'', n, ...]. Its batch rows are the CFG branches the strategy *computed*, in the
``[cond; uncond]`` layout (B'' = computed branches x B): all branches for ``full``, only ``cond`` on LazyMAR's cached
steps (its condition cache derives ``uncond``). Its n token rows are either every row of the stack at this step
(the encoder's buffer + known tokens, the decoder's buffer + all tokens) or, at a caching strategy's cached layers,
the rows the strategy computed there, which it records as ``plan.active[stack]`` (a bool mask over
``[buffer; tokens]``, True = computed) in the step's :class:`~mar_probe.engine.strategy.StepPlan`. Both built-in
caching strategies pass active rows to the blocks in position order, so the j-th row a hook sees is the j-th True
entry of the mask.
"""
from __future__ import annotations

import torch

STACK_NAMES = {"enc": "encoder", "dec": "decoder"}


def _rows_of(mask: torch.Tensor) -> torch.Tensor:
    """Indices [B, n] of the True entries of a bool mask [B, N] holding the same count n in every row."""
    return mask.nonzero(as_tuple=True)[1].reshape(mask.shape[0], -1)


class StepRows:
    """The row map of one step, from the sampler's :class:`~mar_probe.engine.loop.StepState` and the strategy's plan.

    Parameters
    ----------
    state : StepState
        The step (batch size, branches, encoder positions).
    tokens : int
        Length of the store's token axis (buffer + image tokens).
    plan : StepPlan, optional
        ``state.outputs.plan``; None means every branch, row and layer was computed.
    """

    def __init__(self, state, tokens: int, plan=None):
        self.state, self.tokens, self.b = state, tokens, state.batch_size
        computed = tuple(plan.computed) if plan is not None and plan.computed else tuple(state.branches)
        if computed != tuple(state.branches[:len(computed)]):
            raise ValueError(f"the probe maps hook rows to CFG branches in the [cond; uncond] layout, so the computed "
                             f"branches must come first; the strategy's plan computed {computed!r} of "
                             f"{tuple(state.branches)!r}")
        self.computed = computed
        self.derived = tuple(plan.derived) if plan is not None else ()
        self.active = dict(plan.active) if plan is not None else {}
        self.counts = dict(plan.rows) if plan is not None else {}

    def _group(self, t: torch.Tensor, g: int) -> torch.Tensor:
        return t[g * self.b:(g + 1) * self.b]

    def full(self, stack: str, g: int) -> torch.Tensor:
        """Positions [B, N] of every row of ``stack`` (``enc``/``dec``) at this step, branch group ``g``."""
        if stack == "enc":
            return self._group(self.state.enc_positions, g)
        return torch.arange(self.tokens, device=self.state.mask.device).expand(self.b, -1)

    def positions(self, name: str, stack: str, n: int, g: int) -> torch.Tensor:
        """Positions [B, n] of the n rows hook ``name`` saw in branch group ``g``."""
        full = self.full(stack, g)
        if n == full.shape[1]:
            return full
        act = self.active.get(STACK_NAMES[stack])
        got = None if act is None else int(act[0].sum())
        if got != n:
            raise ValueError(f"hook {name!r} saw {n} token rows; expected all {full.shape[1]} rows of the step or the "
                             f"{got!r} active rows of the strategy's plan (plan.active[{STACK_NAMES[stack]!r}])")
        return _rows_of(self._group(act, g))

    def computed_mask(self, stack: str, layer: int, branch: str) -> torch.Tensor:
        """Bool [B, S+L]: rows whose q/k/v layer ``layer`` of ``stack`` computed at this step for ``branch``."""
        out = torch.zeros(self.b, self.tokens, dtype=torch.bool, device=self.state.mask.device)
        if branch not in self.computed:
            return out
        g = self.computed.index(branch)
        full = self.full(stack, g)
        counts = self.counts.get(STACK_NAMES[stack])
        if counts is None or counts[layer] >= full.shape[1]:
            return out.scatter_(1, full, True)
        act = self.active.get(STACK_NAMES[stack])
        if act is None:
            raise ValueError(f"the strategy's plan computed {counts[layer]!r} of {full.shape[1]} rows at "
                             f"{STACK_NAMES[stack]} layer {layer} but gives no plan.active[{STACK_NAMES[stack]!r}] "
                             "mask saying which")
        return self._group(act, g).to(out.device).clone()

    def z_valid(self, branch: str) -> torch.Tensor:
        """Bool [B, S+L]: rows whose head condition z was computed at this step (derived branches: as ``cond``'s)."""
        if branch in self.computed:
            g = self.computed.index(branch)
        elif branch in self.derived:
            g = 0
        else:
            return torch.zeros(self.b, self.tokens, dtype=torch.bool, device=self.state.mask.device)
        act = self.active.get("decoder")
        if act is None:
            return torch.ones(self.b, self.tokens, dtype=torch.bool, device=self.state.mask.device)
        return self._group(act, g).clone()
