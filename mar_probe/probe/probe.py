"""The :class:`Probe`: a sampler observer that records the selected variables of every selected step.

The sampler tells the probe what each step is (:class:`~mar_probe.engine.loop.StepState`): the step index, CFG
branches, where every encoder row sits, the masks and the CFG scale — nothing is inferred by counting forwards.
Hooks keep each captured tensor in the storage dtype, split by CFG branch; derived quantities (``z_cfg_resid``,
``attn_gen``) are computed from the captured tensors while they are in memory, in float32. At ``step_end`` the
rows are placed on the full ``[buffer; tokens]`` axis (NaN where not processed) and the step's arrays go to the
sink as one :class:`StepRecord`.

**Strategies that compute only some rows** (``lazymar``, ``marche``): the probe records what the strategy really
computed. The rows a hook saw are mapped to token positions with the step's
:class:`~mar_probe.engine.strategy.StepPlan` (see :mod:`mar_probe.probe.rows`); rows and branches that were not
computed at a layer are NaN, and beside them

* ``enc_computed`` / ``dec_computed`` [sample, step, branch, layer, token] (bool) say which rows each layer
  computed at the step — its attention queries, i.e. its q/k/v. At LazyMAR's pruning layer q/k/v/attn_out/
  resid_mid are computed for every row but mlp_out/resid_post only for the rows it keeps (their NaN says so);
* ``derived`` [sample, step, branch] (bool) flags a branch the strategy derived instead of computing
  (LazyMAR's condition cache: ``uncond = cond + cached residual``). Such a branch has NaN activations, while its
  ``z`` holds the derived value the head used;
* ``z`` is NaN on rows whose decoder output came from a cache (not computed at the step); the head reads only the
  generating rows, which are always computed. ``z_cfg_resid`` is NaN where either branch's ``z`` is;
* ``attn_gen`` needs every key of the layer: it is NaN at layers where some keys were served from the cache
  (hooks see only the fresh ones), and exact at fully computed layers (MARché's selection layer among them).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import torch

from ..hooks import trace
from ..store.schema import RunLayout, resolve
from ..store.spec import SelectionSpec
from ..store.variables import VARIABLES
from ..vocab import PREFIXES
from .rows import StepRows

_TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StepRecord:
    """The arrays of one step for a batch: ``rows`` are positions on the store's sample axis."""
    rows: tuple[int, ...]
    step: int
    step_pos: int
    arrays: dict


@dataclass
class _Capture:
    """One hook's tensor for one variable and layer: ``parts[branch]`` [B, n, ...] over the n rows it saw."""
    name: str
    rows: int
    groups: int
    parts: dict


def _routes(layout: RunLayout) -> dict[str, list[tuple[str, int]]]:
    """Hook name -> [(variable, layer position)] for the selected variables, from their declared hooks
    (:data:`~mar_probe.store.variables.VARIABLES`; ``attn_gen`` reads q and k)."""
    routes: dict[str, list] = {}
    for name in layout.spec.variables:
        var = VARIABLES[name]
        layers = layout.layers[var.stack] if var.layered else (None,)
        for pos, layer in enumerate(layers):
            for hook in var.hook_names(layer):
                routes.setdefault(hook, []).append((name, pos))
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
        self._dtype = _TORCH_DTYPES[layout.spec.dtype]
        self._device = next(model.parameters()).device
        self._rows: tuple[int, ...] = ()
        self._state = None
        self._cap: dict = {}
        self._qk: dict = {}
        self._resid = None

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
        self._cap, self._qk, self._resid = {}, {}, None
        pos = self.layout.step_index(state.step)
        self._state = state if pos is not None else None
        if self._state is not None and len(self._rows) != state.batch_size:
            raise ValueError(f"probe got a batch of {state.batch_size} images but begin_batch declared "
                             f"{len(self._rows)} sample rows {self._rows!r}; call begin_batch before each batch")

    def step_end(self, state, sampled) -> None:
        if self._state is None:
            return
        rows = StepRows(state, self.layout.dims.tokens, state.outputs.plan)
        arrays = {var: self._encode(self._finish(var, rows)) for var in self.layout.spec.variables}
        arrays.update(self._masks(rows))
        arrays.update(self._bookkeeping(state))
        arrays = {k: _host(v) for k, v in arrays.items()}
        self.sink(StepRecord(self._rows, state.step, self.layout.step_index(state.step), arrays))
        self._state, self._cap, self._qk, self._resid = None, {}, {}, None

    # ---- capture ---------------------------------------------------------------------------------------
    def _capture(self, name: str, tensor: torch.Tensor) -> None:
        s = self._state
        if s is None:
            return
        groups, rem = divmod(tensor.shape[0], s.batch_size)
        if rem or not 1 <= groups <= len(s.branches):
            raise ValueError(f"hook {name!r} saw {tensor.shape[0]} batch rows; expected a multiple of the batch "
                             f"size {s.batch_size} for up to {len(s.branches)} CFG branches {s.branches!r}")
        for var, pos in self.routes[name]:
            derive = VARIABLES[var].derive
            if derive == "attn_gen":
                self._capture_qk(name, pos, tensor, groups)
            elif derive == "cfg_resid":
                b = s.batch_size
                self._resid = tensor[:b].float() - tensor[b:2 * b].float()          # [B, L, D]
            else:
                t = tensor.transpose(1, 2) if tensor.dim() == 4 else tensor       # [B'', H, n, Dh] -> [B'', n, H, Dh]
                self._cap[(var, pos)] = _Capture(name, t.shape[1], groups, self._split(t, groups))

    def _split(self, t: torch.Tensor, groups: int) -> dict:
        """[groups x B, ...] -> {branch: [B, ...]} for the kept branches, in the storage dtype (a copy)."""
        b = self._state.batch_size
        return {br: t[j * b:(j + 1) * b].to(self._dtype, copy=True)
                for j, br in enumerate(self._state.branches[:groups]) if br in self.layout.branches}

    def _capture_qk(self, name: str, pos: int, tensor: torch.Tensor, groups: int) -> None:
        self._qk[(pos, name.rsplit("_", 1)[1])] = tensor
        if (pos, "q") in self._qk and (pos, "k") in self._qk:
            q, k = self._qk.pop((pos, "q")), self._qk.pop((pos, "k"))
            n = self.layout.dims.tokens
            if q.shape[2] == n and k.shape[2] == n:  # every key computed: the score is exact (else NaN)
                self._cap[("attn_gen", pos)] = _Capture(name, n, groups, self._split(self._attn_gen(q, k), groups))

    def _attn_gen(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Mean over heads and generating query rows of softmax(q k^T / sqrt(Dh)) -> [B'', N]."""
        s = self._state
        groups = q.shape[0] // s.batch_size
        gen = s.to_pred.repeat(groups, 1).nonzero(as_tuple=True)[1].reshape(q.shape[0], -1) + self.layout.dims.buffer
        idx = gen[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1])             # [B'', H, G, Dh]
        qg = torch.gather(q, 2, idx).float()                                              # [B'', H, G, Dh]
        att = torch.softmax(qg @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)  # [B'', H, G, N]
        return att.mean(dim=(1, 2))                                                       # [B'', N]

    # ---- assembly --------------------------------------------------------------------------------------
    def _finish(self, var: str, rows: StepRows) -> torch.Tensor:
        """The step array of ``var`` [B, branches, (layers,) S+L, ...]; NaN where nothing was computed."""
        lay = self.layout.variables[var]
        out = torch.full((self._state.batch_size,) + lay.shape[2:], float("nan"), dtype=self._dtype,
                         device=self._device)
        declared = VARIABLES[var]
        if declared.derive == "cfg_resid":
            return self._finish_resid(out, rows)
        layered, stack = declared.layered, declared.stack
        for li in range(lay.shape[3] if layered else 1):
            cap = self._cap.get((var, li))
            if cap is None:
                continue
            if layered and cap.groups != len(rows.computed):
                raise ValueError(f"hook {cap.name!r} saw {cap.groups} CFG branch(es) but the strategy's plan "
                                 f"computed {rows.computed!r}")
            for bi, br in enumerate(self.layout.branches):
                if br in cap.parts:
                    target = out[:, bi, li] if layered else out[:, bi]
                    self._place(target, cap, br, stack if layered else None, rows)
        return out

    def _place(self, target: torch.Tensor, cap: _Capture, branch: str, stack: str | None, rows: StepRows) -> None:
        """Write the rows of ``cap.parts[branch]`` [B, n, ...] at their positions in ``target`` [B, S+L, ...];
        ``stack`` None: the model's output hook, over every image token (NaN where the decoder output was cached)."""
        part, s = cap.parts[branch].to(target.device), self.layout.dims.buffer
        if stack is None:
            target[:, s:] = part
            target[~rows.z_valid(branch).to(target.device)] = float("nan")
            return
        pos = rows.positions(cap.name, stack, cap.rows, self._state.branches.index(branch)).to(target.device)
        target[torch.arange(part.shape[0], device=target.device)[:, None], pos] = part

    def _finish_resid(self, out: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """z_cond - z_uncond [B, S+L, D] (float32 difference, then the storage dtype); NaN where either z is."""
        if self._resid is None:
            return out
        out[:, self.layout.dims.buffer:] = self._resid.to(out.device, self._dtype)
        valid = (rows.z_valid("cond") & rows.z_valid("uncond")).to(out.device)
        out[~valid] = float("nan")
        return out

    def _masks(self, rows: StepRows) -> dict:
        """``derived`` [B, branches] and ``enc_computed``/``dec_computed`` [B, branches, layers, S+L]."""
        b, branches = self._state.batch_size, self.layout.branches
        out = {"derived": torch.tensor([[br in rows.derived for br in branches]] * b, dtype=torch.bool)}
        for stack in PREFIXES:
            if f"{stack}_computed" not in self.layout.variables:
                continue
            layers = self.layout.layers[stack]
            mask = torch.zeros(b, len(branches), len(layers), self.layout.dims.tokens, dtype=torch.bool)
            for bi, br in enumerate(branches):
                for li, layer in enumerate(layers):
                    mask[:, bi, li] = rows.computed_mask(stack, layer, br).cpu()
            out[f"{stack}_computed"] = mask
        return out

    def _encode(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # bf16 bit pattern, uint16 at the sink

    def _bookkeeping(self, state) -> dict:
        b, s = state.batch_size, self.layout.dims.buffer
        known = torch.zeros(b, s, dtype=torch.bool, device=state.mask.device)
        cfg = float(state.cfg_iter.reshape(-1)[0]) if isinstance(state.cfg_iter, torch.Tensor) else state.cfg_iter
        return {"mask": torch.cat([known, state.mask], 1), "pred": torch.cat([known, state.to_pred], 1),
                "cfg": np.full(b, cfg, dtype=np.float32)}


def _host(v) -> np.ndarray:
    """Device tensor -> numpy; int16 bit patterns of bfloat16 become uint16 (the stored form)."""
    if isinstance(v, torch.Tensor):
        v = v.cpu().numpy()
    return v.view(np.uint16) if v.dtype == np.int16 else v
