"""Shadow mode: beside any strategy, the full model runs on the same inputs at every step, and the error of what
the strategy used is recorded against those fresh values, per step, layer and token.

What the strategy *used* is read from the hook points while it runs (the rows it computed) plus, for the rows it
did not compute, the last values it computed for them: every cache in :mod:`mar_probe.strategies` holds exactly
that (position-indexed K/V written whenever a row is computed), so the shadow keeps the same mirror without
reaching into a strategy. The reference (:func:`~mar_probe.strategies.reference.reference_trace`) runs with hooks
suspended, so other observers (the probe) never see it, and outside the strategy's timer (costs stay the
strategy's own). Errors are relative L2 errors ``|used - fresh| / |fresh|``:

* ``enc_kv_err``, ``dec_kv_err`` [sample, step, branch, layer, token]: the keys and values (heads concatenated)
  that attention saw at every row of the stack — exactly 0 for rows recomputed from exact inputs.
* ``enc_resid_err``, ``dec_resid_err``: the block output (resid_post) of the rows the strategy computed (NaN for
  rows it did not compute: their hidden state is not used, only their cached K/V).
* ``z_err`` [sample, step, branch, token]: the head condition of the generating tokens (the only rows the head
  reads), including a derived unconditional branch.
* ``refresh`` [sample, step], ``mask``/``pred`` [sample, step, token], ``enc_active``/``dec_active``
  [sample, step, branch, token] (rows computed at the stack's cached layers; all True on refresh steps).

A branch the strategy derived (LazyMAR's condition cache) has NaN K/V and hidden errors: it used none.
Token axis: ``[buffer; tokens]`` as in the run store (encoder rows of unknown tokens are NaN).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from ..hooks import trace
from ..vocab import BRANCHES, STACK_PREFIX, STACKS
from ..strategies.layers import gather_heads, rows_of, scatter_heads
from ..strategies.reference import kv_error, reference_trace, relative_error



class Shadow:
    """Sampler observer recording shadow errors (see the module docstring); use inside :meth:`attached`.

    Parameters
    ----------
    model : MAR
        The model the sampler runs (mar_probe's MAR: the strategies' block runners and hook points).
    """

    def __init__(self, model):
        self.model = model
        self.depth = {"encoder": len(model.encoder_blocks), "decoder": len(model.decoder_blocks)}
        self.records: list[list[dict]] = []              # per batch, per step
        self._ref = None
        self._cap: dict = {}
        self._mirror: dict = {}

    def hook_names(self) -> list[str]:
        names = ["z"]
        for stack, depth in self.depth.items():
            p = STACK_PREFIX[stack]
            names += [f"{p}.{i}.{q}" for i in range(depth) for q in ("attn.hook_k", "attn.hook_v", "hook_resid_post")]
        return names

    @contextmanager
    def attached(self):
        """Attach the shadow's hooks for the duration of the block."""
        with trace(self.model, self.hook_names(), self._capture):
            yield self

    # ---- observer interface ----------------------------------------------------------------------------
    def step_begin(self, state) -> None:
        if state.step == 0:
            self.records.append([])
            self._mirror = {}
        self._cap = {}
        self._ref = reference_trace(self.model, state)

    def _capture(self, name: str, tensor: torch.Tensor) -> None:
        if self._ref is not None:
            self._cap[name] = tensor

    def step_end(self, state, sampled) -> None:
        plan = state.outputs.plan
        nb_c = len(plan.computed)
        rec = {"refresh": bool(plan.refresh), "mask": _np(_pad(state.mask, self.model.buffer_size, False)),
               "pred": _np(_pad(state.to_pred, self.model.buffer_size, False))}
        for stack in STACKS:
            rec.update(self._stack_errors(state, plan, stack, nb_c))
        rec["z_err"] = self._z_error(state)
        self.records[-1].append(rec)
        self._ref, self._cap = None, {}

    # ---- errors ----------------------------------------------------------------------------------------
    def _stack_errors(self, state, plan, stack: str, nb_c: int) -> dict:
        """K/V and resid errors [B, branches, layers, S+L] and the active rows [B, branches, S+L] of one stack."""
        ref, p = self._ref.stack(stack), STACK_PREFIX[stack]
        b, n_all = state.batch_size, self.model.buffer_size + self.model.seq_len
        bc = nb_c * b                                                       # computed branch rows
        kv = torch.full((len(state.branches) * b, self.depth[stack], n_all), float("nan"))
        resid = kv.clone()
        active = torch.zeros(len(state.branches) * b, n_all, dtype=torch.bool)
        pos = ref.positions[:bc]                                            # [Bc, N] rows of this step
        for i in range(self.depth[stack]):
            k, v = self._cap[f"{p}.{i}.attn.hook_k"], self._cap[f"{p}.{i}.attn.hook_v"]
            rows = self._rows(plan, stack, pos, k.shape[2], f"{p}.{i}.attn.hook_k")
            mk, mv = self._mirror_store(stack, i, k, v, rows, ref, n_all)
            used_k, used_v = gather_heads(mk, pos), gather_heads(mv, pos)  # [Bc, H, N, Dh]
            err = kv_error(used_k, used_v, ref.k[i][:bc], ref.v[i][:bc])    # [Bc, N]
            kv[:bc, i].scatter_(1, pos.cpu(), err.cpu())
            out = self._cap[f"{p}.{i}.hook_resid_post"]                    # [Bc, n, D]
            rows = self._rows(plan, stack, pos, out.shape[1], f"{p}.{i}.hook_resid_post")
            fresh = _gather_at(ref.out[i][:bc], pos, rows)                  # [Bc, n, D]
            resid[:bc, i].scatter_(1, rows.cpu(), relative_error(out, fresh).cpu())
        if stack in plan.active:
            active[:bc] = plan.active[stack][:bc].cpu()
        else:
            active[:bc].scatter_(1, pos.cpu(), True)
        return {f"{p}_kv_err": _by_branch(kv, b), f"{p}_resid_err": _by_branch(resid, b),
                f"{p}_active": _by_branch(active, b)}

    def _rows(self, plan, stack, pos, n: int, name: str) -> torch.Tensor:
        """Positions [Bc, n] of the n rows a hook saw: all rows of the step, or the plan's active rows."""
        if n == pos.shape[1]:
            return pos
        act = plan.active.get(stack)
        if act is None or int(act[0].sum()) != n:
            got = None if act is None else int(act[0].sum())
            raise ValueError(f"shadow: hook {name!r} saw {n} rows; expected all {pos.shape[1]} rows of the step or "
                             f"the plan's {got!r} active rows")
        return rows_of(act[:pos.shape[0]])

    def _mirror_store(self, stack, i, k, v, rows, ref, n_all):
        """Write the computed K/V [Bc, H, n, Dh] at ``rows`` into the last-computed mirror; return the mirror."""
        key = (stack, i)
        if key not in self._mirror:
            shape = (ref.k[i].shape[0], ref.k[i].shape[1], n_all, ref.k[i].shape[-1])
            self._mirror[key] = (ref.k[i].new_zeros(shape), ref.v[i].new_zeros(shape))
        mk, mv = self._mirror[key]
        scatter_heads(mk, rows, k.to(mk.dtype))
        scatter_heads(mv, rows, v.to(mv.dtype))
        return mk, mv

    def _z_error(self, state) -> np.ndarray:
        """Relative error of the head condition of the generating tokens [B, branches, S+L] (NaN elsewhere)."""
        z = self._cap["z"]                                                  # [B', L, D] as the strategy used
        err = relative_error(z, self._ref.z).cpu()                          # [B', L]
        err[~state.to_pred_branches.cpu()] = float("nan")
        return _by_branch(_pad(err, self.model.buffer_size, float("nan")), state.batch_size)

    # ---- result ----------------------------------------------------------------------------------------
    def to_dataset(self, strategy: dict | None = None):
        """All recorded batches as an :class:`xarray.Dataset` (samples in batch order)."""
        import xarray as xr
        if not self.records:
            raise ValueError("the shadow recorded nothing: sample with it among the observers, inside attached()")
        arrays = {k: np.concatenate([np.stack([r[k] for r in batch], axis=1) for batch in self.records])
                  for k in self.records[0][0] if k != "refresh"}
        same = self.depth["encoder"] == self.depth["decoder"]
        layer = {p: "layer" if same else f"{p}_layer" for p in STACK_PREFIX.values()}
        data = {}
        for name, arr in arrays.items():
            if name in ("mask", "pred"):
                data[name] = (("sample", "step", "token"), arr)
            elif name.endswith("_active") or name == "z_err":
                data[name] = (("sample", "step", "branch", "token"), arr)
            else:
                data[name] = (("sample", "step", "branch", layer[name[:3]], "token"), arr)
        refresh = np.concatenate([np.array([[r["refresh"] for r in batch]] * len(batch[0]["mask"]))
                                  for batch in self.records])
        data["refresh"] = (("sample", "step"), refresh)
        branches = BRANCHES[:arrays["z_err"].shape[2]]
        ds = xr.Dataset(data, coords={"branch": list(branches), "step": np.arange(refresh.shape[1])})
        return ds.assign_attrs(metric="relative L2 error |used - fresh| / |fresh|",
                               strategy=str(strategy) if strategy is not None else "")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _pad(t: torch.Tensor, buffer: int, value) -> torch.Tensor:
    """[B, L] over image tokens -> [B, S+L] with ``value`` on the buffer rows."""
    return torch.cat([torch.full((t.shape[0], buffer), value, dtype=t.dtype, device=t.device), t], dim=1)


def _by_branch(t: torch.Tensor, b: int) -> np.ndarray:
    """[nb x B, ...] in the [cond; uncond] layout -> numpy [B, nb, ...]."""
    t = t.detach().cpu()
    return t.reshape((t.shape[0] // b, b) + tuple(t.shape[1:])).transpose(0, 1).numpy()


def _gather_at(x: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of x [B, N, D] (laid out at positions pos [B, N]) found at positions rows [B, n] -> [B, n, D]."""
    if rows is pos:
        return x
    grid = x.new_zeros(x.shape[0], int(pos.max()) + 1, x.shape[-1]).scatter_(
        1, pos.unsqueeze(-1).expand(-1, -1, x.shape[-1]), x)                # [B, max pos + 1, D]
    return torch.gather(grid, 1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def sample_with_shadow(model, labels, **sample_kwargs):
    """:func:`mar_probe.sample` with a :class:`Shadow` attached; returns ``(SampleResult, shadow Dataset)``."""
    from ..api import sample
    shadow = Shadow(model)
    observers = list(sample_kwargs.pop("observers", ())) + [shadow]
    with shadow.attached():
        res = sample(model, labels, observers=observers, **sample_kwargs)
    return res, shadow.to_dataset(res.settings.get("strategy"))
