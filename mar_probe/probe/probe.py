"""The :class:`Probe`: a sampler observer that records the selected variables of every selected step.

The sampler tells the probe what each step is (:class:`~mar_probe.sampler.StepState`): the step index, CFG
branches, where every encoder row sits, the masks and the CFG scale — nothing is inferred by counting forwards.
Hooks convert each captured tensor at once to its storage layout on the model's device (branch selection,
encoder rows scattered onto the full ``[buffer; tokens]`` axis with NaN elsewhere, storage dtype); derived
quantities (``z_cfg_resid``, ``attn_gen``) are computed from the captured tensors while they are in memory.
At ``step_end`` the step's arrays go to the sink as one :class:`StepRecord`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..hooks import trace
from ..store.schema import RunLayout, resolve
from .spec import SelectionSpec

_HOOK_OF = {"q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v", "resid_post": "hook_resid_post",
            "resid_mid": "hook_resid_mid", "attn_out": "attn.hook_attn_out", "mlp_out": "hook_mlp_out"}


@dataclass
class StepRecord:
    """The arrays of one step for a batch: ``rows`` are positions on the store's sample axis."""
    rows: tuple[int, ...]
    step: int
    step_pos: int
    arrays: dict


def _routes(layout: RunLayout) -> dict[str, list[tuple[str, int]]]:
    """Hook name -> [(variable, layer position)] for the selected variables (attn_gen reads q and k)."""
    routes: dict[str, list] = {}
    for var in layout.spec.variables:
        if var in ("z", "z_cfg_resid"):
            routes.setdefault("z", []).append((var, 0))
            continue
        if var == "attn_gen":
            for pos, layer in enumerate(layout.layers["dec"]):
                for q in ("q", "k"):
                    routes.setdefault(f"dec.{layer}.attn.hook_{q}", []).append(("attn_gen", pos))
            continue
        stack, quantity = var.split("_", 1)
        for pos, layer in enumerate(layout.layers[stack]):
            routes.setdefault(f"{stack}.{layer}.{_HOOK_OF[quantity]}", []).append((var, pos))
    return routes


class Probe:
    """Records the variables selected by a resolved :class:`~mar_probe.store.schema.RunLayout`.

    Parameters
    ----------
    model : MAR
        The model the sampler runs (mar_probe's or an official instance).
    layout : RunLayout
        The resolved selection (see :meth:`for_run`).
    sink : callable, optional
        Receives each :class:`StepRecord`; default: append to :attr:`records`.
    """

    def __init__(self, model, layout: RunLayout, sink: Callable[[StepRecord], None] | None = None):
        self.model, self.layout = model, layout
        self.records: list[StepRecord] = []
        self.sink = sink or self.records.append
        self.routes = _routes(layout)
        self._rows: tuple[int, ...] = ()
        self._state = None
        self._cap: dict = {}
        self._qk: dict = {}

    @classmethod
    def for_run(cls, model, spec: SelectionSpec, *, num_samples: int, num_iter: int, cfg: float, sink=None):
        """A probe for a run of ``num_samples`` samples with ``num_iter`` steps at guidance ``cfg``."""
        return cls(model, resolve(spec, model, num_samples=num_samples, num_iter=num_iter, cfg=cfg), sink)

    @contextmanager
    def attached(self):
        """Attach the probe's forward hooks for the duration of the block."""
        with trace(self.model, list(self.routes), self._capture):
            yield self

    def begin_batch(self, rows) -> None:
        """Declare the store sample positions of the next batch's images, in batch order."""
        self._rows = tuple(int(r) for r in rows)

    # ---- observer interface ----------------------------------------------------------------------------
    def step_begin(self, state) -> None:
        self._cap, self._qk = {}, {}
        pos = self.layout.step_index(state.step)
        self._state = state if pos is not None else None
        if self._state is not None and len(self._rows) != state.batch_size:
            raise ValueError(f"probe got a batch of {state.batch_size} images but begin_batch declared "
                             f"{len(self._rows)} sample rows {self._rows!r}; call begin_batch before each batch")

    def step_end(self, state, sampled) -> None:
        if self._state is None:
            return
        arrays = {var: self._finish(var) for var in self.layout.spec.variables}
        arrays.update(self._bookkeeping(state))
        arrays = {k: _host(v) for k, v in arrays.items()}
        self.sink(StepRecord(self._rows, state.step, self.layout.step_index(state.step), arrays))
        self._state, self._cap, self._qk = None, {}, {}

    # ---- capture ---------------------------------------------------------------------------------------
    def _capture(self, name: str, tensor: torch.Tensor) -> None:
        if self._state is None:
            return
        for var, pos in self.routes[name]:
            if var == "attn_gen":
                self._capture_qk(name, pos, tensor)
            elif var == "z_cfg_resid":
                b = self._state.batch_size
                resid = tensor[:b].float() - tensor[b:2 * b].float()             # [B, L, D]
                self._cap[(var, 0)] = self._encode(self._pad_buffer(resid))
            else:
                self._cap[(var, pos)] = self._encode(self._select_branches(self._to_tokens(name, tensor)))

    def _capture_qk(self, name: str, pos: int, tensor: torch.Tensor) -> None:
        self._qk[(pos, name.rsplit("_", 1)[1])] = tensor
        if (pos, "q") in self._qk and (pos, "k") in self._qk:
            q, k = self._qk.pop((pos, "q")), self._qk.pop((pos, "k"))
            self._cap[("attn_gen", pos)] = self._encode(self._select_branches(self._attn_gen(q, k)))

    def _attn_gen(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Mean over heads and generating query rows of softmax(q k^T / sqrt(Dh)) -> [B', N]."""
        s = self._state
        gen = s.to_pred_branches.nonzero(as_tuple=True)[1].reshape(q.shape[0], -1) + self.layout.dims.buffer  # [B', G]
        idx = gen[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1])             # [B', H, G, Dh]
        qg = torch.gather(q, 2, idx).float()                                              # [B', H, G, Dh]
        att = torch.softmax(qg @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)  # [B', H, G, N]
        return att.mean(dim=(1, 2))                                                       # [B', N]

    def _to_tokens(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Captured tensor -> [B', S+L, ...] on the full token axis (NaN where not processed)."""
        if t.dim() == 4:
            t = t.transpose(1, 2)                                          # [B', H, N, Dh] -> [B', N, H, Dh]
        if name == "z":
            return self._pad_buffer(t)
        n_all = self.layout.dims.tokens
        if name.startswith("dec."):
            if t.shape[1] != n_all:
                raise ValueError(f"hook {name!r} saw {t.shape[1]} rows, expected all {n_all} decoder rows; "
                                 "the strategy computes partial rows, which the probe cannot record yet")
            return t
        pos = self._state.enc_positions                                    # [B', Nenc]
        if t.shape[1] != pos.shape[1]:
            raise ValueError(f"hook {name!r} saw {t.shape[1]} rows, expected the step's {pos.shape[1]} encoder "
                             "rows; the strategy computes partial rows, which the probe cannot record yet")
        out = t.new_full((t.shape[0], n_all) + tuple(t.shape[2:]), float("nan"))
        out[torch.arange(t.shape[0], device=t.device)[:, None], pos] = t   # scatter rows onto [B', S+L, ...]
        return out

    def _pad_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] image-token tensor -> [B, S+L, ...] with NaN on the buffer rows."""
        pad = t.new_full((t.shape[0], self.layout.dims.buffer) + tuple(t.shape[2:]), float("nan"))
        return torch.cat([pad, t], dim=1)

    def _select_branches(self, t: torch.Tensor) -> torch.Tensor:
        """[B', ...] in the [cond; uncond] layout -> [B, branches kept, ...]."""
        s = self._state
        t = t.reshape((len(s.branches), s.batch_size) + tuple(t.shape[1:]))  # [nb, B, ...]
        keep = [s.branches.index(b) for b in self.layout.branches]
        return t[keep].transpose(0, 1)                                      # [B, nkeep, ...]

    def _encode(self, t: torch.Tensor) -> torch.Tensor:
        dtype = self.layout.spec.dtype
        if dtype == "bfloat16":
            return t.to(torch.bfloat16).view(torch.int16)  # bit pattern; numpy view as uint16 at the sink
        return t.to(getattr(torch, dtype))

    # ---- assembly --------------------------------------------------------------------------------------
    def _finish(self, var: str):
        """Stack the captured layers of ``var`` into its step array [B, ...] (NaN where a hook did not fire)."""
        lay = self.layout.variables[var]
        shape = (self._state.batch_size,) + lay.shape[2:]
        nlayers = shape[2] if var.startswith(("enc_", "dec_")) or var == "attn_gen" else 0
        if nlayers == 0:
            got = self._cap.get((var, 0))
            return got if got is not None else _fill(shape, lay)
        parts = [self._cap.get((var, p)) for p in range(nlayers)]
        if all(p is not None for p in parts):
            return torch.stack(parts, dim=2)                               # [B, nb, layers, ...]
        out = _fill(shape, lay)
        for p, t in enumerate(parts):
            if t is not None:
                out[:, :, p] = t.cpu().numpy().view(out.dtype)
        return out

    def _bookkeeping(self, state) -> dict:
        b, s = state.batch_size, self.layout.dims.buffer
        known = torch.zeros(b, s, dtype=torch.bool, device=state.mask.device)
        cfg = float(state.cfg_iter.reshape(-1)[0]) if isinstance(state.cfg_iter, torch.Tensor) else state.cfg_iter
        return {"mask": torch.cat([known, state.mask], 1), "pred": torch.cat([known, state.to_pred], 1),
                "cfg": np.full(b, cfg, dtype=np.float32)}


def _fill(shape, lay) -> np.ndarray:
    return np.full(shape, lay.fill, dtype=lay.dtype)


def _host(v) -> np.ndarray:
    """Device tensor -> numpy; int16 bit patterns of bfloat16 become uint16 (the stored form)."""
    if isinstance(v, torch.Tensor):
        v = v.cpu().numpy()
    return v.view(np.uint16) if v.dtype == np.int16 else v
