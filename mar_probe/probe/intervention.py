"""Interventions during sampling: write hooks that know the step (issue 18, item 5).

:func:`mar_probe.hooks.edit` replaces a hook point's tensor in any forward. During sampling an edit usually
depends on where the loop is: freeze token 17's K at the value it had at step 3, ablate a head only while the
last tokens are generated, patch in the activations of another run at the same step. :class:`Intervention` is a
sampler observer (it sees each :class:`~mar_probe.engine.loop.StepState` before the step is computed) whose edit
functions receive that state::

    def freeze(name, k, state):                  # k [B', H, N, Dh]
        if state.step == 3:
            saved[name] = k.clone()
        elif state.step > 3:
            k = k.clone()
            k[..., 17, :] = saved[name][..., 17, :]
            return k

    iv = Intervention(model, {"dec.0.attn.hook_k": freeze})
    with iv.attached():
        res = mar_probe.sample(model, labels, observers=[iv])
"""
from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Callable

import torch

from ..hooks import edit

StepEditFn = Callable[[str, torch.Tensor, object], "torch.Tensor | None"]


class Intervention:
    """Edits of hook points as functions of ``(name, tensor, state)``; pass it to ``observers`` and attach it.

    Parameters
    ----------
    model : MAR
        mar_probe's MAR (see :func:`mar_probe.hooks.edit`).
    edits : dict
        Hook name -> function of (name, tensor in its canonical shape, the step's ``StepState``) returning a
        replacement of the same shape and dtype, or None to keep the tensor.
    """

    def __init__(self, model, edits: dict[str, StepEditFn]):
        self.model = model
        self.edits = dict(edits)
        self.state = None

    def step_begin(self, state) -> None:
        self.state = state

    def _bind(self, fn: StepEditFn):
        def bound(name, tensor):
            if self.state is None:
                raise RuntimeError("Intervention saw a forward before any step began: pass it to the sampler's "
                                   "observers (sample(..., observers=[intervention]))")
            return fn(name, tensor, self.state)
        return bound

    @contextmanager
    def attached(self):
        """The write hooks, attached for the block and removed on exit."""
        with edit(self.model, {name: self._bind(fn) for name, fn in self.edits.items()}):
            yield self
        self.state = None
