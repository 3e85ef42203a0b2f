"""``marche``: MARché (cache-aware attention with attention-guided selective KV refresh), as its paper describes.

How it applies to MAR's two stacks (the paper speaks of one transformer; MAR has an encoder over the buffer and
the known tokens and a decoder over the buffer and all tokens). Both stacks are treated the same way, each with
its own position-indexed cache of keys/values per layer and of its last-layer output:

* Layers ``0..selection_layer`` (0-based, as every layer index in mar_probe) run full attention (and the FFN) on
  every row of the stack, every step. The default ``selection_layer=1`` is the paper's (1-based) "layer 2".
* At layer ``selection_layer`` the head-averaged attention of the *anchor* rows ranks all rows; the active set is
  the *must* rows plus the top-K ranked others, K = budget - |must| (>= 0: must rows are always computed, even
  beyond the budget).
* From the next layer on (``selection_layer + 1 .. depth - 1``, the cached layers), active rows attend to their
  fresh K/V and to the cached K/V of the other rows through cache-aware attention (two partial attentions merged
  with log-sum-exp); only active rows run the FFN and update the cache. Rows not active take their stack output
  from the output cache.
* Everything is recomputed (and the caches refreshed) at step 0 and whenever ``step % refresh_period == 0``.

Beyond the paper (options, all off by default):

* ``selection="oracle"``: rank by the *true* drift — the relative error of each row's cached K/V against the full
  model's fresh K/V on the same inputs, averaged over the cached layers (the reference forward of
  :mod:`~mar_probe.strategies.reference`; not counted in time or FLOPs: an upper bound for selection rules).
* ``refresh_threshold > 0``: drift-triggered refresh. The cheap estimate is the mean relative change, over the
  decoder's rows, of the selection layer's output since the last refresh (that layer runs in full every step
  anyway); a step refreshes when the estimate measured at the previous step exceeds the threshold, or when
  ``refresh_period`` steps have passed since the last refresh (a cap; set it to the step count to disable).
* ``refresh_mass > 0``: a budget that adapts per step: the fewest top-ranked refreshing rows whose share of the
  ranking scores over the non-must rows reaches ``refresh_mass`` (the maximum over batch rows, so every row keeps
  the same count), never more than ``budget - |must|``.

Decoder: anchors = generating tokens (decoded at this step, whose outputs the head needs); must = generating +
caching tokens (decoded at the previous step, whose decoder input changed). Encoder: the generating tokens are
not in the encoder (it sees only known tokens), so the anchors and must rows are the caching tokens: they are
the rows new to the encoder (no cached K/V exists for them) and the only inputs that changed since the last step.
Both CFG branches are computed, each with its own selection. ``stacks`` limits MARché to one stack (the other
then runs in full). A stack with no layer after the selection layer (depth <= ``selection_layer + 1``) runs in
full.

``selection_layer`` was 1-based (default 2) until issue 18, the only 1-based layer index in mar_probe; it is now
0-based like hook names (``dec.3.attn.hook_k``), store coordinates and LazyMAR's ``prune_layer``, so one index
names one layer everywhere (the papers' 1-based names appear only in labels). Old value ``v`` is new ``v - 1``,
with bit-identical results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._config import check_ints
from ..vocab import STACKS
from . import register
from ..engine.strategy import StepPlan, Strategy, count_blocks, count_embeddings, stack_blocks
from .layers import (KVCache, active_attention, block_mlp, full_block, gather_heads, gather_rows, rows_of,
                     scatter_rows)
from .reference import kv_error, reference_trace, relative_error

SELECTIONS = ("attention", "low-attention", "random", "oracle")


@dataclass(frozen=True, kw_only=True)
class MARcheConfig:
    """Options of :class:`MARcheStrategy` (paper defaults).

    budget : active rows per cached layer (generating + caching + refreshing).
    selection_layer : 0-based index of the layer whose head-averaged attention ranks the rows; layers
        ``0..selection_layer`` run in full, the later ones are cached. The paper's 1-based "layer 2" is index 1
        (the default). 1-based before issue 18 (old ``v`` = new ``v - 1``).
    refresh_period : full recompute when ``step % refresh_period == 0`` (and at step 0).
    selection : ``attention`` (top-K attended), ``low-attention`` (least attended), ``random`` or ``oracle``
        (top-K true K/V drift, see the module docstring).
    stacks : stacks that use cache-aware layers (``encoder``, ``decoder``).
    seed : seed of the ``random`` selection.
    refresh_threshold : > 0: drift-triggered refresh at this estimate (``refresh_period`` is then a cap).
    refresh_mass : in (0, 1]: adaptive budget covering this share of the ranking scores (0: fixed budget).
    """
    budget: int = 64
    selection_layer: int = 1
    refresh_period: int = 3
    selection: str = "attention"
    stacks: tuple[str, ...] = STACKS
    seed: int = 0
    refresh_threshold: float = 0.0
    refresh_mass: float = 0.0

    def __post_init__(self):
        check_ints("marche", self, (("budget", 1), ("selection_layer", 0), ("refresh_period", 1)))
        if self.selection not in SELECTIONS:
            raise ValueError(f"marche selection must be one of {SELECTIONS!r}, got {self.selection!r}")
        bad = [s for s in self.stacks if s not in STACKS]
        if bad or not isinstance(self.stacks, tuple):
            raise ValueError(f"marche stacks must be a tuple of 'encoder'/'decoder', got {self.stacks!r}")
        if not self.refresh_threshold >= 0:
            raise ValueError("marche refresh_threshold must be >= 0 (0: periodic refresh), got "
                             f"{self.refresh_threshold!r}")
        if not 0 <= self.refresh_mass <= 1:
            raise ValueError(f"marche refresh_mass must be in [0, 1] (0: fixed budget), got {self.refresh_mass!r}")
        if self.refresh_mass > 0 and self.selection in ("random", "low-attention"):
            raise ValueError(f"marche refresh_mass needs a ranking score (selection 'attention' or 'oracle'), "
                             f"got selection {self.selection!r}")


@register("marche")
class MARcheStrategy(Strategy):
    """MARché on MAR's encoder and decoder (see the module docstring)."""

    name = "marche"
    Config = MARcheConfig

    def __init__(self, **options):
        self.config = self.Config(**options)
        self.caches: dict[str, KVCache] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.prev_to_pred = None
        self.generator = None
        self.reference = None                 # oracle: the full model's trace of the current step
        self.snapshot: dict[str, torch.Tensor] = {}   # drift trigger: selection-layer output at the last refresh
        self.drift_estimate, self.last_refresh = 0.0, 0

    @classmethod
    def exact_options(cls, num_iter):
        return {"refresh_period": 1}

    def begin(self, model, batch_size, num_iter):
        n = model.buffer_size + model.seq_len
        if self.config.budget > n:
            raise ValueError(f"marche budget {self.config.budget!r} exceeds the sequence: expected at most "
                             f"{n} rows (buffer {model.buffer_size} + {model.seq_len} tokens)")
        self.caches = {s: KVCache() for s in STACKS}
        self.outputs, self.prev_to_pred, self.snapshot = {}, None, {}
        self.drift_estimate, self.last_refresh = 0.0, 0
        self.generator = torch.Generator(next(model.parameters()).device).manual_seed(self.config.seed)

    def is_refresh(self, step: int) -> bool:
        """Whether every row of every layer is recomputed at ``step``."""
        c = self.config
        if step == 0 or self.prev_to_pred is None:
            return True
        if c.refresh_threshold > 0:
            return self.drift_estimate > c.refresh_threshold or step - self.last_refresh >= c.refresh_period
        return step % c.refresh_period == 0

    def hidden(self, model, state, timer):
        refresh = self.is_refresh(state.step)
        if refresh:
            self.last_refresh, self.drift_estimate = state.step, 0.0
        self.reference = reference_trace(model, state) if self.config.selection == "oracle" and not refresh else None
        plan = StepPlan(refresh=refresh, computed=state.branches)
        s, n_dec = model.buffer_size, model.buffer_size + model.seq_len
        b = state.tokens_in.shape[0]
        prev = self._prev_full(model, state, b)                        # [B', S+L] decoded at the previous step
        with timer("encoder"):
            x = model.encoder_input(state.tokens_in, state.mask_in, state.class_embedding)  # [B', Nenc, D]
            pos = state.enc_positions                                                       # [B', Nenc]
            must = torch.gather(prev, 1, pos) if not refresh else None
            x = self._stack(model, "encoder", x, pos, must, must, refresh, plan, timer)
            x = model.encoder_norm(x)
        with timer("decoder"):
            x = model.decoder_input(x, state.mask_in)                  # [B', S+L, D]
            gen = torch.cat([prev.new_zeros(b, s), state.to_pred_branches], dim=1)          # [B', S+L]
            pos = torch.arange(n_dec, device=x.device).expand(b, -1)
            must = (gen | prev) if not refresh else None
            x = self._stack(model, "decoder", x, pos, gen, must, refresh, plan, timer)
        count_embeddings(timer, model, b, state.enc_positions.shape[1])
        self.prev_to_pred = state.to_pred
        state.outputs.plan = plan
        return x

    def _prev_full(self, model, state, b):
        prev = torch.zeros_like(state.mask_in) if self.prev_to_pred is None else \
            self.prev_to_pred.repeat(len(state.branches), 1)            # [B', L]
        return torch.cat([torch.zeros(b, model.buffer_size, dtype=torch.bool, device=prev.device), prev], dim=1)

    def _stack(self, model, stack, x, pos, anchors, must, refresh, plan, timer):
        """Run one stack on rows x [B', N, D] at positions pos [B', N]; returns its last hidden state."""
        blocks = stack_blocks(model, stack)
        sel = self.config.selection_layer
        if refresh or stack not in self.config.stacks or len(blocks) <= sel + 1:       # no layer to cache
            return self._full_stack(model, stack, blocks, x, pos, plan, timer)
        b, n, _ = x.shape
        for i in range(sel):                                               # layers before the selection layer
            x, _, _ = full_block(blocks[i], x)
        x, scores = self._selection_block(blocks[sel], x, anchors)        # scores [B', N]
        if self.config.selection == "oracle":
            scores = self._drift_scores(stack, pos)
        if self.config.refresh_threshold > 0 and stack == "decoder":
            self.drift_estimate = float(relative_error(x, self.snapshot[stack][:b]).mean())
        active = self._select(scores, must)                                # [B', N] bool
        act_idx, cached_idx = rows_of(active), rows_of(~active)            # [B', Na], [B', Nc]
        pos_a, pos_c = torch.gather(pos, 1, act_idx), torch.gather(pos, 1, cached_idx)
        xa = gather_rows(x, act_idx)                                       # [B', Na, D]
        cache = self.caches[stack]
        for i in range(sel + 1, len(blocks)):                              # the cached layers
            kc, vc = cache.fetch(i, pos_c)
            xm, k, v = active_attention(blocks[i], xa, kc, vc)
            xa = block_mlp(blocks[i], xm)
            cache.store(i, k, v, pos_a, cache.k[i].shape[2])
        out = gather_rows(self.outputs[stack], pos)                        # [B', N, D] cached outputs
        scatter_rows(out, act_idx, xa)
        scatter_rows(self.outputs[stack], pos_a, xa)
        na = act_idx.shape[1]
        n_anchor = int(anchors[0].sum())
        count_blocks(timer, model, stack, b, n, n, layers=sel + 1, extra_qk=n_anchor)
        count_blocks(timer, model, stack, b, na, n, layers=len(blocks) - sel - 1)
        plan.rows[stack] = [n] * (sel + 1) + [na] * (len(blocks) - sel - 1)
        plan.active[stack] = torch.zeros(b, model.buffer_size + model.seq_len, dtype=torch.bool,
                                         device=x.device).scatter_(1, pos_a, True)
        return out

    def _full_stack(self, model, stack, blocks, x, pos, plan, timer):
        """Every layer on every row (bit-identical to the model's forward); refreshes the caches."""
        b, n, _ = x.shape
        length = model.buffer_size + model.seq_len
        cache = self.caches[stack]
        full_positions = None if n == length else pos
        for i, block in enumerate(blocks):
            x, k, v = full_block(block, x)
            if i > self.config.selection_layer:                            # the layers cached between refreshes
                cache.store(i, k, v, full_positions, length)
            if i == self.config.selection_layer and self.config.refresh_threshold > 0:
                self.snapshot[stack] = x
        if stack not in self.outputs:
            self.outputs[stack] = x.new_zeros(b, length, x.shape[-1])
        scatter_rows(self.outputs[stack], pos, x)
        count_blocks(timer, model, stack, b, n, n, layers=len(blocks))
        plan.rows[stack] = [n] * len(blocks)
        return x

    def _selection_block(self, block, x, anchors):
        """Full block on x [B', N, D] plus the head- and anchor-averaged attention of the anchor rows [B', N]."""
        q, k, v = block.attn.qkv_heads(block.norm1(x))
        out = block.hook_resid_mid(x + block.attn.project(block.attn.attend(q, k, v)))
        out = block_mlp(block, out)
        a_idx = rows_of(anchors)                                           # [B', Na]
        if a_idx.shape[1] == 0:
            return out, torch.zeros(x.shape[:2], device=x.device)
        qa = gather_heads(q, a_idx)                                        # [B', H, Na, Dh]
        probs = torch.softmax((qa @ k.transpose(-2, -1)) * block.attn.scale, dim=-1)  # [B', H, Na, N]
        return out, probs.mean(dim=(1, 2))

    def _drift_scores(self, stack, pos):
        """Oracle ranking [B', N]: relative error of the cached K/V of the rows at ``pos`` against the reference,
        mean over the cached layers."""
        ref, cache = self.reference.stack(stack), self.caches[stack]
        layers = range(self.config.selection_layer + 1, len(ref.k))
        return sum(kv_error(*cache.fetch(i, pos), ref.k[i], ref.v[i]) for i in layers) / len(layers)

    def _select(self, scores, must):
        """Active rows [B', N]: ``must`` plus the top-K others by the selection rule, K = budget - |must|."""
        n_must = int(must[0].sum())
        k = max(0, min(self.config.budget - n_must, must.shape[1] - n_must))
        active = must.clone()
        if k > 0 and self.config.refresh_mass > 0:
            k = min(k, _mass_count(scores.masked_fill(must, 0.0).clamp_min(0.0), self.config.refresh_mass))
        if k == 0:
            return active
        rule = self.config.selection
        if rule == "random":
            scores = torch.rand(scores.shape, generator=self.generator, device=self.generator.device).to(scores.device)
        if rule == "low-attention":
            scores = -scores
        scores = scores.masked_fill(must, float("-inf"))
        return active.scatter_(1, scores.topk(k, dim=1).indices, True)


def _mass_count(scores: torch.Tensor, mass: float) -> int:
    """Fewest top rows whose scores reach ``mass`` of each row's total [B', N] -> count (max over batch rows)."""
    top = scores.sort(dim=1, descending=True).values
    cum = top.cumsum(1)
    need = (cum < mass * cum[:, -1:]).sum(1) + 1                     # [B']
    return int(need.max())
