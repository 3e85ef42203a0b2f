"""``recap``: ReCAP, context-feature reuse (Liu et al., "Plug-and-Play Context Feature Reuse for Efficient Masked
Generation", arXiv 2505.19089), as its released code (liebenxj/ReCAP, folder ``examples/MAR+ReCAP``; line numbers
below are of commit 4d1da38) does it for MAR.

The paper (abstract) "interleaves standard full evaluations with lightweight steps that cache and reuse context
features": the decoding steps are grouped; each group starts with a full pass, whose keys and values of the
*context* are reused by the group's cheap steps, which compute only the rows that changed or are being generated.
In MAR's two stacks, as the code does it (``models/mar.py``):

* Schedule (``sample_tokens``, lines 456-457, 481-498, 522, 537, 583 and 616): steps ``< warmup_steps`` are
  ordinary full steps (the code's ``pre_full_iters``); from then on each full pass starts a group of
  ``1 + cached_steps`` steps (``num_cache_iters``), cut short at the end of the run (the code's loop over
  ``mask_lens`` stops at ratio 1, lines 493-496). So with ``warmup_steps=4, cached_steps=1`` an 8-step run is full
  at steps 0-4 and 6 and cheap at 5 and 7. :func:`recap_schedule` gives every step's role.
* The group's tokens are those MAR's cosine schedule generates over its steps (``mask_to_pred`` = mask before the
  group xor mask after it, lines 503-509; the last group takes every token left). Per step the counts are
  MAR's, and so is the CFG scale (lines 516-519, 597-600).
* Full pass (lines 470-473): the whole encoder and decoder on both CFG branches, bit-identical to ``full``; it keeps
  every layer's K/V of both stacks (``return_kv``).
* Cheap steps, encoder (lines 552-560, 593): the cached context is the K/V of the tokens known at the group's full
  pass; the computed rows are the buffer and the group's tokens generated since (their queries attend to their own
  fresh K/V and the cached context, ``Attention.forward`` lines 58-60: cached K/V concatenated before the fresh).
* Cheap steps, decoder (lines 437-442, 563-565, 595): the cached K/V are those of every position outside the group
  (known tokens *and* tokens still masked after the group), from the full pass; the computed rows are the buffer
  and every token of the group (those generated since the full pass, with their new encoder output, and those
  still masked, as mask tokens). Cheap steps never write the cache: each one recomputes all of its group's rows
  against the full pass's context.
* CFG: cheap steps compute both branches, each against its own branch's cache (lines 589-592, 608).
* Head: full steps sample with the head's own reverse steps; cheap steps with ``int(T * head_fraction)`` evenly
  respaced steps, ``T`` the head's own (``models/diffloss.py`` lines 51-54 and 67-71, ``fast=True`` at
  ``models/mar.py`` line 604: the code's ``diff_fast_ratio``), with no timestep clamp (``diffusion/__init__.py``
  lines 11-47 has none). The group's first tokens, sampled from the full pass, use the full head (line 574).

Every constant of the released code is an option with the default its published MAR commands use
(``run_mar_recap.sh``: MAR-L lines 3-18, MAR-H lines 23-34; the README has no MAR-B command, and none of the
constants depends on the model size):

* ``warmup_steps`` None = ``num_iter // 2``: every command sets ``pre_full_iters=$((num_iter/2))`` (lines 4, 8, 13,
  17, 24, 28, 33). The argparse default is 0 (``cache_decoding.py`` line 98), which no command uses.
* ``cached_steps`` 1: every command's ``--num_cache_iters 1``, also the argparse default (``cache_decoding.py``
  line 99) and ``sample_tokens``' (``models/mar.py`` line 446).
* ``head_fraction`` 0.4: every command's ``--diff_fast_ratio 0.4`` (40 of the official 100 head steps). The argparse
  default is 1.0 (``cache_decoding.py`` line 73), ``sample_tokens``' 0.5 (line 446).
* ``cache_buffer`` False: ``--cache_buffer`` is a ``store_true`` flag no command sets (``cache_decoding.py`` line
  97; ``sample_tokens``' own default True, line 446, is always overridden by it). True caches the buffer's K/V too:
  cheap steps then compute only token rows (lines 441, 560).
* The commands' step counts (MAR-L 96, 84, 56, 36; MAR-H 128, 96, 48), CFG (3.0, 3.2, linear) and 100 head steps
  are sampling settings (``SamplingConfig``), not options of this strategy.

Where this differs from the code, deliberately:

* Which of a group's tokens each step generates: MAR's order (the engine's plan), the first ``n`` of the group in
  generation order at the full step. The code takes the group's first ``n`` in *raster* order (``torch.where`` over
  the group's mask, line 538, sliced at line 570): the same group, the same counts per step, another split inside
  the group (a raster bias the paper does not describe).
* ``head_fraction`` is a number: the code declares ``--diff_fast_ratio`` a string (``cache_decoding.py`` line 73), so
  ``int(int("100") * "0.4")`` at ``models/diffloss.py`` line 53 repeats the string and fails; the value the commands
  pass, 0.4, is what is meant. ``T`` is the head's step count (the code's ``int(num_sampling_steps)``, which a
  sectioned respacing such as ``"25,25"`` would not parse).
* Rows outside the computed ones keep the full pass's decoder output in :meth:`ReCAPStrategy.hidden` (the head reads
  only the step's generated tokens, which are always computed), so that ``compose`` can hold ``recap`` as its token
  policy (its cheap steps then sample with ``compose``'s head, not the shorter one).

With ``cached_steps=0`` (or ``warmup_steps >= num_iter``) every step is a full pass: ``full`` bit for bit
(:meth:`ReCAPStrategy.exact_options`). FLOPs count what runs: on cheap steps ``na`` query rows per layer attend to
``na`` fresh plus the cached keys, and only those rows run qkv, proj and the MLP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._config import check_ints
from . import register
from ..engine.loop import mask_length
from ..engine.strategy import StepPlan, Strategy, count_blocks, count_embeddings
from .layers import KVCache, active_attention, block_mlp, full_block, rows_of, scatter_rows


def recap_schedule(num_iter: int, warmup_steps: int, cached_steps: int) -> list[int]:
    """Role of every step of a ``num_iter``-step run: 0 for a full pass, ``j > 0`` for the ``j``-th cheap step
    after its group's full pass (the released code's loop, see the module docstring)."""
    for name, value, low in (("num_iter", num_iter, 1), ("warmup_steps", warmup_steps, 0),
                             ("cached_steps", cached_steps, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"recap schedule {name} must be an integer >= {low}, got {value!r}")
    roles, step = [], 0
    while step < num_iter:
        size = min(1 + (cached_steps if step >= warmup_steps else 0), num_iter - step)
        roles.extend(range(size))
        step += size
    return roles


@dataclass(frozen=True, kw_only=True)
class ReCAPConfig:
    """Options of :class:`ReCAPStrategy`, defaults from the released code's MAR commands (see the module docstring).

    warmup_steps : steps computed in full before the groups start (None: ``num_iter // 2``); ``pre_full_iters``.
    cached_steps : cheap steps after each full pass once the groups start (0: every step full); ``num_cache_iters``.
    head_fraction : in (0, 1]: cheap steps' head samples with ``int(T * head_fraction)`` of the head's ``T`` steps;
        ``diff_fast_ratio``.
    cache_buffer : reuse the buffer's K/V too (cheap steps compute token rows only); ``cache_buffer``.
    """
    warmup_steps: int | None = None
    cached_steps: int = 1
    head_fraction: float = 0.4
    cache_buffer: bool = False

    def __post_init__(self):
        check_ints("recap", self, (("cached_steps", 0),))
        w = self.warmup_steps
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise ValueError(f"recap warmup_steps must be an integer >= 0 or None (num_iter // 2), got {w!r}")
        f = self.head_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"recap head_fraction must be a number in (0, 1], got {f!r}")
        if not isinstance(self.cache_buffer, bool):
            raise ValueError(f"recap cache_buffer must be True or False, got {self.cache_buffer!r}")


@dataclass
class _Group:
    """What a group's full pass leaves for its cheap steps (branch layout ``[cond; uncond]``)."""
    known: torch.Tensor       # [B', L] tokens known at the full pass: the encoder's cached context
    tokens: torch.Tensor      # [B', L] tokens the group generates: the decoder's computed token rows
    hidden: torch.Tensor      # [B', S+L, D] the full pass's last decoder hidden state


@register("recap")
class ReCAPStrategy(Strategy):
    """ReCAP: groups of a full pass and cheap steps reusing its context K/V (see the module docstring)."""

    name = "recap"
    Config = ReCAPConfig

    def __init__(self, **options):
        self.config = ReCAPConfig(**options)
        self._roles: dict[int, list[int]] = {}
        self.num_iter: int | None = None
        self._reset()

    def _reset(self):
        self.caches = {"encoder": KVCache(), "decoder": KVCache()}
        self.group: _Group | None = None

    @classmethod
    def exact_options(cls, num_iter):
        return {"cached_steps": 0}

    def schedule(self, num_iter: int) -> list[int]:
        """Role of every step of a ``num_iter``-step run (:func:`recap_schedule` with this strategy's options)."""
        if num_iter not in self._roles:
            w = self.config.warmup_steps
            self._roles[num_iter] = recap_schedule(num_iter, num_iter // 2 if w is None else w,
                                                   self.config.cached_steps)
        return self._roles[num_iter]

    def cheap_head_steps(self, model) -> int:
        """Head steps of the cheap steps on ``model``: ``int(T * head_fraction)``, T the head's own."""
        own, f = model.diffloss.gen_diffusion.num_timesteps, self.config.head_fraction
        steps = int(own * f)
        if steps < 2:
            raise ValueError(f"recap head_fraction {f!r} leaves int({own} * {f!r}) = {steps} head steps at cheap steps "
                             f"of this model (its head has {own}); expected at least 2: a reverse process of one step "
                             "has no posterior variance")
        return steps

    def begin(self, model, batch_size, num_iter):
        self._reset()
        self.num_iter = num_iter
        if any(self.schedule(num_iter)):
            self.cheap_head_steps(model)                  # a bad fraction fails before the first step

    def is_refresh(self, step: int) -> bool:
        """Whether ``step`` of the run :meth:`begin` started is a full pass (True before any run)."""
        roles = self.schedule(self.num_iter) if self.num_iter is not None else ()
        return step >= len(roles) or roles[step] == 0

    def head_steps(self, model, state):
        return None if self.schedule(state.num_iter)[state.step] == 0 else self.cheap_head_steps(model)

    def hidden(self, model, state, timer):
        roles = self.schedule(state.num_iter)
        if roles[state.step] > 0:
            return self._cheap(model, state, timer)
        size = 1
        while state.step + size < len(roles) and roles[state.step + size] > 0:
            size += 1
        return self._full(model, state, timer, size)

    # ---- full passes -----------------------------------------------------------------------------------
    def _full(self, model, state, timer, size):
        """Every row of both stacks (as ``full``); keeps the context for a group of ``size`` steps (> 1)."""
        b, length = state.tokens_in.shape[0], model.buffer_size + model.seq_len
        keep = size > 1
        with timer("encoder"):
            x = model.encoder_input(state.tokens_in, state.mask_in, state.class_embedding)   # [B', Nenc, D]
            x = model.encoder_norm(self._full_stack(model.encoder_blocks, x, "encoder", state.enc_positions, keep,
                                                   length))
        with timer("decoder"):
            x = model.decoder_input(x, state.mask_in)                                       # [B', S+L, D]
            x = self._full_stack(model.decoder_blocks, x, "decoder", None, keep, length)
        n_enc = state.enc_positions.shape[1]
        count_embeddings(timer, model, b, n_enc)
        count_blocks(timer, model, "encoder", b, n_enc, n_enc, layers=len(model.encoder_blocks))
        count_blocks(timer, model, "decoder", b, length, length, layers=len(model.decoder_blocks))
        state.outputs.plan = StepPlan(refresh=True, computed=state.branches, rows={
            "encoder": [n_enc] * len(model.encoder_blocks), "decoder": [length] * len(model.decoder_blocks)})
        if keep:
            nb = len(state.branches)
            tokens = self._group_tokens(model, state, size).repeat(nb, 1)
            self.group = _Group(known=~state.mask_in, tokens=tokens, hidden=x)
        return x

    def _full_stack(self, blocks, x, stack, positions, keep, length):
        """Every block on every row; with ``keep``, each layer's K/V into the stack's cache over ``length``
        positions (``positions`` [B', N] of the rows, None: all in order)."""
        for i, block in enumerate(blocks):
            x, k, v = full_block(block, x)
            if keep:
                self.caches[stack].store(i, k, v, positions, length)
        return x

    def _group_tokens(self, model, state, size):
        """Tokens [B, L] MAR's schedule generates over the ``size`` steps from ``state``'s step."""
        end = state.step + size - 1
        if end >= state.num_iter - 1:
            return state.mask.clone()                    # the last step takes every token left
        n = int(state.mask[0].sum())
        for j in range(state.step, end + 1):
            n = mask_length(j, state.num_iter, model.seq_len, n)
        after = torch.zeros_like(state.mask).scatter(-1, state.orders[:, :n], True)
        return state.mask & ~after

    # ---- cheap steps -----------------------------------------------------------------------------------
    def _cheap(self, model, state, timer):
        """The group's rows against the full pass's context K/V; the other rows keep the full pass's output."""
        g, b, s = self.group, state.tokens_in.shape[0], model.buffer_size
        if g is None or g.known.shape[0] < b:
            raise RuntimeError(f"recap step {state.step} is a cheap step but no full pass of its group ran before it")
        known, group = g.known[:b], g.tokens[:b]
        if (state.to_pred_branches[:b] & ~group).any():
            raise RuntimeError(f"recap step {state.step} generates tokens outside its group: the run's schedule is "
                               "not the one its full pass planned")
        new = group & ~state.mask_in                                     # [b, L] generated since the full pass
        buf = torch.full((b, s), not self.config.cache_buffer, dtype=torch.bool, device=new.device)
        enc_act, dec_act = torch.cat([buf, new], 1), torch.cat([buf, group], 1)   # [b, S+L] computed rows
        enc_ctx = torch.cat([~buf, known], 1)                            # [b, S+L] cached rows of the encoder
        enc_pos, dec_pos = rows_of(enc_act), rows_of(dec_act)
        with timer("encoder"):
            x = model.encoder_input(state.tokens_in, ~new, state.class_embedding)      # [b, S + n_new, D]
            x = x[:, s:] if self.config.cache_buffer else x
            x = model.encoder_norm(self._cached_stack(model.encoder_blocks, x, "encoder", rows_of(enc_ctx)))
        with timer("decoder"):
            x = _decoder_rows(model, x, enc_pos, dec_pos)                               # [b, Na, D]
            x = self._cached_stack(model.decoder_blocks, x, "decoder", rows_of(~dec_act))
            out = g.hidden[:b].clone()
            scatter_rows(out, dec_pos, x)
        na_e, nc_e, na_d = enc_pos.shape[1], int(enc_ctx[0].sum()), dec_pos.shape[1]
        count_embeddings(timer, model, b, na_e)                          # z_proj on every token, decoder_embed on na_e
        count_blocks(timer, model, "encoder", b, na_e, na_e + nc_e, layers=len(model.encoder_blocks))
        count_blocks(timer, model, "decoder", b, na_d, out.shape[1], layers=len(model.decoder_blocks))
        state.outputs.plan = StepPlan(refresh=False, computed=state.branches,
                                      rows={"encoder": [na_e] * len(model.encoder_blocks),
                                            "decoder": [na_d] * len(model.decoder_blocks)},
                                      active={"encoder": enc_act, "decoder": dec_act})
        return out

    def _cached_stack(self, blocks, x, stack, cached_pos):
        for i, block in enumerate(blocks):
            kc, vc = self.caches[stack].fetch(i, cached_pos)
            xm, _, _ = active_attention(block, x, kc, vc)
            x = block_mlp(block, xm)
        return x


def _decoder_rows(model, x_enc, enc_pos, dec_pos):
    """Decoder input [b, Na, D] of the rows at ``dec_pos`` [b, Na] (sorted): the embedded encoder output x_enc of the
    rows at ``enc_pos`` (a subset), mask tokens elsewhere, plus the positions' embeddings (``decoder_input``'s rows)."""
    d = model.decoder_embed(x_enc)
    rows = model.mask_token.to(d.dtype).expand(dec_pos.shape[0], dec_pos.shape[1], -1).clone()
    scatter_rows(rows, torch.searchsorted(dec_pos, enc_pos), d)
    return rows + model.decoder_pos_embed_learned[0][dec_pos]
