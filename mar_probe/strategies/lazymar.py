"""``lazymar``: LazyMAR (Yan et al., ICCV 2025) as its paper and released code (feihongyan1/LazyMAR) do it.

Every constant of the released code is an option with the code's default:

* Schedule: full computation while ``step < warmup_steps`` (5) and whenever ``(step - warmup_steps) %
  refresh_interval == 0`` (9); the other steps are *cached* steps. Full steps compute both CFG branches of every
  row and layer (bit-identical to ``full``) and refresh every cache.
* Token cache, encoder: on cached steps only the buffer rows and the tokens decoded at the previous step are
  computed; they attend to their fresh K/V and to the cached K/V of the other known tokens (cache-aware attention).
  The decoder input of the other rows comes from the decoder-input cache.
* Token cache, decoder: layers ``0..prune_layer-1`` and the attention of layer ``prune_layer`` (3) run on every row;
  there the rows are ranked by the cosine similarity of their V to the cached V of the previous step (mean over
  heads), generating and just-decoded tokens scored 0, and the ``max(generating + just-decoded + min_extra_tokens,
  int(N * retain_schedule[step]))`` lowest kept (ascending sort, as the code). Kept rows run the rest of the decoder
  against cached K/V of the others; the stack output of the others is zero, as in the code (only generating rows
  are read by the head).
* Condition cache: cached steps compute only the conditional branch; the unconditional last-layer hidden state is
  the conditional one plus ``uncond - cond`` cached at the last full step.

The three caches are separate parts (issue 18, item 4): the token cache is :class:`LazyMARTokens` (a token policy
that computes whichever branches its step state holds), the condition cache the
:class:`~mar_probe.strategies.condition_cache.ConditionCache` and the head cache the
:class:`~mar_probe.strategies.head_cache.HeadCache` that ``compose`` holds too, so ``compose tokens=lazymar`` is
``lazymar`` bit for bit.
* Diffusion-head cache, within each step's diffusion sampling: the network runs in full (both CFG halves) at
  reverse index ``i == T-1`` and ``i % head_interval == 0`` (7), storing each residual block's MLP output, the
  increments of blocks ``head_delta_blocks`` (1-4) and ``cond_eps - uncond_eps``. In between only the conditional
  half runs: delta blocks add their cached increment, other blocks reuse the cached MLP output with a fresh AdaLN
  gate (recomputing it while ``i > head_warm_fraction * T``), and ``uncond_eps = cond_eps - cached difference``.
* ``head_batch_modulation`` (off by default; not in the released code): the AdaLN modulations that the head's
  evaluations of a step need (a function of the timestep and of ``z``, both known before the reverse loop) are made
  in one batched matrix product per layer over all reverse indices of a kind (recompute, cached) instead of one
  small product per evaluation: the same products and the same values up to floating-point summation order. The
  tables hold every index's timestep embedding, so evaluations skip ``time_embed`` and ``cond_embed(z)`` runs once
  per step (z is the same at every index): fewer FLOPs by exactly those embeddings. On a CPU at batch 1 the head's
  evaluations are bound by reading weights, which this reads once per step. With ``head_interval=1`` and no token or
  condition cache this is ``full`` with only that reorganisation, the fair reference for its speed-up.

Where the released code has no behaviour this follows the obvious extension: without CFG (the code needs it)
no condition cache is used and the head cache runs on the single branch; a schedule shorter than the step count
repeats its last ratio; a decoder with at most ``prune_layer`` layers prunes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._config import check_ints
from . import register
from .condition_cache import ConditionCache
from .head_cache import HeadCache, HeadCacheConfig
from ..engine.cost import linear_flops
from ..engine.strategy import StepPlan, Strategy, count_blocks, count_embeddings
from .layers import KVCache, active_attention, block_mlp, full_block, gather_rows, rows_of, scatter_rows

HEAD_OPTIONS: tuple[str, ...] = ("head_cache", "head_interval", "head_warm_fraction", "head_delta_blocks",
                                 "head_batch_modulation")
"""Options of the head cache (:class:`~.head_cache.HeadCache`), which the token cache does not read."""
CONDITION_OPTIONS: tuple[str, ...] = ("condition_cache",)
"""Options of the condition cache (:class:`~.condition_cache.ConditionCache`), which the token cache does not read."""
RETAIN_SCHEDULE = (1.0,) * 20 + (0.6,) + (0.5,) * 4 + (0.4,) * 5 + (0.15,) * 5 + (0.12,) * 5 + (0.05,) * 24


@dataclass(frozen=True, kw_only=True)
class LazyMARConfig:
    """Options of :class:`LazyMARStrategy`, defaults from the released code (see the module docstring)."""
    warmup_steps: int = 5
    refresh_interval: int = 9
    prune_layer: int = 3
    min_extra_tokens: int = 15
    retain_schedule: tuple[float, ...] = RETAIN_SCHEDULE
    head_interval: int = 7
    head_warm_fraction: float = 0.9
    head_delta_blocks: tuple[int, ...] = (1, 2, 3, 4)
    token_cache: bool = True
    condition_cache: bool = True
    head_cache: bool = True
    head_batch_modulation: bool = False

    def __post_init__(self):
        check_ints("lazymar", self, (("warmup_steps", 0), ("refresh_interval", 1), ("prune_layer", 0),
                                     ("min_extra_tokens", 0), ("head_interval", 1)))
        if not self.retain_schedule or any(not 0.0 <= r <= 1.0 for r in self.retain_schedule):
            raise ValueError(f"lazymar retain_schedule must be a non-empty tuple of ratios in [0, 1], "
                             f"got {self.retain_schedule!r}")
        if not 0.0 <= self.head_warm_fraction <= 1.0:
            raise ValueError(f"lazymar head_warm_fraction must be in [0, 1], got {self.head_warm_fraction!r}")
        if any(not isinstance(j, int) or j < 0 for j in self.head_delta_blocks):
            raise ValueError(f"lazymar head_delta_blocks must be block indices >= 0, got {self.head_delta_blocks!r}")

    def head_config(self) -> HeadCacheConfig:
        """The ``head_*`` options as the head cache's config (the part that runs them)."""
        return HeadCacheConfig(interval=self.head_interval, warm_fraction=self.head_warm_fraction,
                               delta_blocks=tuple(self.head_delta_blocks), batch_modulation=self.head_batch_modulation)


@register("lazymar")
class LazyMARStrategy(Strategy):
    """LazyMAR as three parts (issue 18, item 4): its token cache (:class:`LazyMARTokens`), the condition cache
    (:class:`~mar_probe.strategies.condition_cache.ConditionCache`) and the diffusion-head cache
    (:class:`~mar_probe.strategies.head_cache.HeadCache`); see the module docstring."""

    name = "lazymar"
    Config = LazyMARConfig

    def __init__(self, **options):
        self.config = c = LazyMARConfig(**options)
        self.tokens = LazyMARTokens(c)
        self.condition = ConditionCache() if c.condition_cache else None
        self.head = HeadCache(c.head_config())

    @classmethod
    def exact_options(cls, num_iter):
        return {"refresh_interval": 1, "head_interval": 1}

    def token_policy(self):
        return self.tokens

    def begin(self, model, batch_size, num_iter):
        self.tokens.begin(model, batch_size, num_iter)
        for part in (self.condition, self.head):
            if part is not None:
                part.reset()

    def is_refresh(self, step: int) -> bool:
        return self.tokens.is_refresh(step)

    def hidden(self, model, state, timer):
        if self.condition is None:
            return self.tokens.hidden(model, state, timer)
        return self.condition.hidden(self.tokens, model, state, timer)

    def head_sample(self, model, z, state, rng):
        if not self.config.head_cache:
            return super().head_sample(model, z, state, rng)
        return self.head.head_sample(model, z, state, rng)


class LazyMARTokens(Strategy):
    """LazyMAR's token cache alone: the encoder's incremental K/V and the decoder's V-cosine pruning, on the rows of
    the branches the step state holds (both on refresh steps; the conditional one alone on the steps where a
    condition cache derives the other). Its caches keep every row it computed, so the same part serves with or
    without a condition cache (compose holds it as a token policy)."""

    name = "lazymar"

    def __init__(self, config: LazyMARConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget every cached row (a new batch)."""
        self.enc_cache, self.dec_cache = KVCache(), KVCache()
        self.dec_in = self.prev_to_pred = None

    def to_dict(self) -> dict:
        return {"name": self.name, **{k: v for k, v in dataclasses.asdict(self.config).items()
                                      if k not in HEAD_OPTIONS + CONDITION_OPTIONS}}

    def begin(self, model, batch_size, num_iter):
        self.reset()

    def is_refresh(self, step: int) -> bool:
        """Whether ``step`` computes everything (warm-up or periodic refresh), as ``global_force_fresh``."""
        c = self.config
        return step < c.warmup_steps or (step - c.warmup_steps) % c.refresh_interval == 0 or self.dec_in is None

    def hidden(self, model, state, timer):
        x = self._full_step(model, state, timer) if self.is_refresh(state.step) else \
            self._cached_step(model, state, timer)
        self.prev_to_pred = state.to_pred
        return x

    # ---- full steps ------------------------------------------------------------------------------------
    def _full_step(self, model, state, timer):
        b, length = state.tokens_in.shape[0], model.buffer_size + model.seq_len
        pos = state.enc_positions                                           # [B', Nenc]
        with timer("encoder"):
            x = model.encoder_input(state.tokens_in, state.mask_in, state.class_embedding)
            for i, block in enumerate(model.encoder_blocks):
                x, k, v = full_block(block, x)
                self.enc_cache.store(i, k, v, pos, length)
            x = model.encoder_norm(x)
        with timer("decoder"):
            x = model.decoder_input(x, state.mask_in)                       # [B', S+L, D]
            self.dec_in = x.clone()
            for i, block in enumerate(model.decoder_blocks):
                x, k, v = full_block(block, x)
                self.dec_cache.store(i, k, v, None, length)
        n_enc = pos.shape[1]
        count_embeddings(timer, model, b, n_enc)
        count_blocks(timer, model, "encoder", b, n_enc, n_enc, layers=len(model.encoder_blocks))
        count_blocks(timer, model, "decoder", b, length, length, layers=len(model.decoder_blocks))
        state.outputs.plan = StepPlan(refresh=True, computed=state.branches, rows={
            "encoder": [n_enc] * len(model.encoder_blocks), "decoder": [length] * len(model.decoder_blocks)})
        return x

    # ---- cached steps ----------------------------------------------------------------------------------
    def _cached_step(self, model, state, timer):
        """The step's rows (B' = B x branches of ``state``; the cache's first B' rows are theirs)."""
        rows = state.tokens_in.shape[0]
        plan = StepPlan(refresh=False, computed=state.branches)
        prev = self._positions_mask(model, self.prev_to_pred, state)      # [B', S+L] decoded last step
        with timer("encoder"):
            self._encoder(model, state, timer, rows, prev, plan)
        with timer("decoder"):
            x = self._decoder(model, state, timer, rows, prev, plan)       # [B', S+L, D]
        state.outputs.plan = plan
        return x

    def _positions_mask(self, model, token_mask, state):
        """Token mask [B, L] -> [B', S+L] over buffer + token positions (buffer False)."""
        m = token_mask.repeat(len(state.branches), 1)
        return torch.cat([torch.zeros(m.shape[0], model.buffer_size, dtype=torch.bool, device=m.device), m], dim=1)

    def _encoder(self, model, state, timer, rows, prev, plan):
        """Buffer + just-decoded rows through the encoder; writes their decoder input into the cache."""
        length = model.buffer_size + model.seq_len
        x = model.encoder_input(state.tokens_in, state.mask_in, state.class_embedding)
        pos = state.enc_positions                                           # [rows, Nenc]
        new = torch.gather(prev, 1, pos)
        new[:, :model.buffer_size] = True                                   # buffer rows come first in pos
        if not self.config.token_cache:
            new[:] = True
        act_idx, cached_idx = rows_of(new), rows_of(~new)                  # [rows, Na], [rows, Nc]
        pos_a, pos_c = torch.gather(pos, 1, act_idx), torch.gather(pos, 1, cached_idx)
        xa = gather_rows(x, act_idx)                                        # [rows, Na, D]
        for i, block in enumerate(model.encoder_blocks):
            kc, vc = self.enc_cache.fetch(i, pos_c)
            xm, k, v = active_attention(block, xa, kc, vc)
            xa = block_mlp(block, xm)
            self.enc_cache.store(i, k, v, pos_a, length)
        xa = model.decoder_embed(model.encoder_norm(xa)) + model.decoder_pos_embed_learned[0, pos_a]
        scatter_rows(self.dec_in, pos_a, xa)
        na, n_enc = act_idx.shape[1], pos.shape[1]
        count_blocks(timer, model, "encoder", rows, na, n_enc, layers=len(model.encoder_blocks))
        count_embeddings(timer, model, rows, 0)
        timer.add_flops("decoder.linear", rows * linear_flops(na, model.decoder_embed.in_features,
                                                              model.decoder_embed.out_features))
        plan.rows["encoder"] = [na] * len(model.encoder_blocks)
        plan.active["encoder"] = torch.zeros_like(prev).scatter_(1, pos_a, True)

    def _decoder(self, model, state, timer, rows, prev, plan):
        """Decoder on the cached decoder input: all rows up to the prune layer, the kept rows after it."""
        blocks, p = model.decoder_blocks, self.config.prune_layer
        x = self.dec_in[:rows].clone()                                      # [rows, S+L, D]
        n = x.shape[1]
        for i in range(min(p, len(blocks))):
            x, k, v = full_block(blocks[i], x)
            self.dec_cache.store(i, k, v, None, n)
        if p >= len(blocks):
            count_blocks(timer, model, "decoder", rows, n, n, layers=len(blocks))
            plan.rows["decoder"] = [n] * len(blocks)
            return x
        x, keep = self._prune_layer(blocks[p], x, state, rows, prev)        # x [rows, Nk, D], keep [rows, Nk]
        keep_c = rows_of(~torch.zeros_like(prev).scatter_(1, keep, True))   # [rows, N - Nk]
        for i in range(p + 1, len(blocks)):
            kc, vc = self.dec_cache.fetch(i, keep_c)
            xm, k, v = active_attention(blocks[i], x, kc, vc)
            x = block_mlp(blocks[i], xm)
            self.dec_cache.store(i, k, v, keep, n)
        nk = keep.shape[1]
        count_blocks(timer, model, "decoder", rows, n, n, layers=p)
        count_blocks(timer, model, "decoder", rows, n, n, layers=1, mlp_rows=nk)
        count_blocks(timer, model, "decoder", rows, nk, n, layers=len(blocks) - p - 1)
        plan.rows["decoder"] = [n] * (p + 1) + [nk] * (len(blocks) - p - 1)
        plan.active["decoder"] = torch.zeros_like(prev).scatter_(1, keep, True)
        return scatter_rows(torch.zeros_like(self.dec_in[:rows]), keep, x)

    def _prune_layer(self, block, x, state, rows, prev):
        """Layer ``prune_layer``: attention on all rows, then keep the rows whose V changed most; MLP on them."""
        p = self.config.prune_layer
        q, k, v = block.attn.qkv_heads(block.norm1(x))
        v_old = self.dec_cache.v[p][:rows]                                  # [rows, H, S+L, Dh]
        self.dec_cache.store(p, k, v, None, x.shape[1])
        x = block.hook_resid_mid(x + block.attn.project(block.attn.attend(q, k, v)))
        score = F.cosine_similarity(v, v_old, dim=-1).mean(dim=1)          # [rows, S+L]
        gen = self._gen_mask(state, rows, x.shape[1])                       # [rows, S+L]
        score[gen] = 0
        score[prev] = 0
        order = torch.sort(score, dim=-1, descending=False).indices
        sched = self.config.retain_schedule
        ratio = sched[min(state.step, len(sched) - 1)]
        n_gen, n_prev = int(gen[0].sum()), int(prev[0].sum())
        fresh = max(n_gen + n_prev + self.config.min_extra_tokens, int(x.shape[1] * ratio))
        if not self.config.token_cache:
            fresh = x.shape[1]
        keep = order[:, :fresh].sort(dim=-1).values                         # [rows, Nk] in position order
        return block_mlp(block, gather_rows(x, keep)), keep

    @staticmethod
    def _gen_mask(state, rows, n):
        """Generating tokens [rows, S+L] (buffer False)."""
        g = state.to_pred_branches[:rows]
        return torch.cat([torch.zeros(rows, n - g.shape[1], dtype=torch.bool, device=g.device), g], dim=1)
