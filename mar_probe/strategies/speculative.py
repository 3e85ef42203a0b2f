"""``speculative``: continuous speculative decoding, CSpD (Wang et al., "Continuous Speculative Decoding for
Autoregressive Image Generation", arXiv 2411.11925), as its released code (MarkXCloud/CSpD; line numbers below are
of commit d91f721) does it for MAR.

A smaller MAR (the *draft*, e.g. the public MAR-B checkpoint) generates most steps; every ``num_draft`` steps the
larger model (the *target*, the model being sampled, e.g. MAR-H) predicts, in one pass, every token drafted since
its last verification, and each drafted token is accepted or replaced. Nothing is trained: the code's only
entry point is ``demo/run_mar.ipynb`` with the official MAR-B as draft and MAR-H as target. What the code does
(``spec_decode/spec_decode_runner.py``, ``SpecDecodeRunner.run``, lines 82-203):

* Noise (lines 101-111): one initial noise per position [B, L, C] and one noise per position and reverse step
  [B, L, T, C], drawn once; both CFG halves share them. Every head of the run, draft or target, samples a token at
  position ``l`` from that position's noises ("denoising trajectory alignment": the two models' reverse processes
  start from the same noise and add the same noise at each step).
* Schedule (lines 113-155, :func:`speculative_schedule`): MAR's cosine schedule and one generation order for the
  whole run; steps ``<= num_iter * prefill_ratio`` are ordinary steps of the target ("token pre-filling"); every
  later step is a draft step (the draft's encoder and decoder on the current tokens, drafted ones included, and its
  head); after the draft step, steps with ``step % num_draft == 0`` (never step 0) and the last step also verify.
* Verification (lines 157-200, ``models/mar.py`` ``sample_tokens_step_with_mask`` lines 351-398): the target's
  encoder sees only the tokens known at its last verification (or the end of the pre-fill), its decoder predicts
  the *window*, every token drafted since (all remaining tokens at the last step), with the step's CFG scale; its
  head samples them from the same noises. Each token is then kept or replaced independently (not cut at the first
  rejection, as the LLM algorithm does; tokens drafted after a rejected one are kept as they are).
* Acceptance (``DistributionProcessor``, lines 8-68, :func:`acceptance_ratio`): the head's last reverse step is
  deterministic (no noise at t = 0), so a drafted token ``x`` is the draft's last mean ``mu_q``. With ``sigma`` the
  last step's standard deviation (times the sampling temperature), ``F = exp(sum over channels of (sum over the
  other reverse steps of log sigma_p - log sigma_q))`` (lines 19, 694 of ``diffusion/gaussian_diffusion.py``) and
  ``tau = inner_temperature``, ``x`` is accepted when
  ``r = exp(-|(x - mu_p) / sigma_p / tau|^2 / 2) * F * prod(sigma_q) / (exp(-|(x - mu_q) / sigma_q / tau|^2 / 2)
  * prod(sigma_p))`` exceeds a uniform draw (lines 35-38, 61-68).
* Replacement (lines 40-59, :func:`residual_sample`): up to ``max_resample`` rounds propose ``y ~ N(mu_p, sigma_p)``
  for every token and accept it where a uniform draw is below ``max(0, N_p(y) - N_q(y) / F) / N_p(y)`` (the normal
  densities of the last step, without ``tau``); a later round's acceptance overwrites an earlier one, the loop stops
  when every token has accepted once, and a token that never does stays zero (line 47), as in the code.

Options (none depends on the model size):

* ``num_draft``: no default. The runner's default is 8 (line 85), the notebook passes 4; the paper's headline
  2.33x (MAR-H target, MAR-B draft, batch 256, A100) is at draft length 32 (of 4, 8, 16, 32 tried). The paper's
  evaluation command is not released, so which value a run uses is the user's choice.
* ``prefill_ratio`` 0.05: the notebook's ``ratio=0.05`` (the runner's own default is 0.15, line 72).
* ``inner_temperature`` 42: the runner's default (line 72), which the notebook keeps.
* ``max_resample`` 100: the code's "try at most 100 times" (line 48).

Where this differs from the code, deliberately:

* Pre-fill steps are :class:`~mar_probe.engine.strategy.FullStrategy` steps: their head draws the engine's noise, not
  the per-position noise (the tokens are never verified, so only the random stream differs). The per-position noises
  are drawn at the first draft step from the run's noise generator. So with ``prefill_ratio=1`` every step is a
  ``full`` step, bit for bit (:meth:`SpeculativeStrategy.exact_options`).
* Both heads sample with the run's head process (the target's ``num_sampling_steps``, or the run's ``head_steps``);
  the code builds both models with the same ``num_sampling_steps``.
* Uniform and normal draws come from the run's noise generator, not torch's global one.

The engine writes only a step's own tokens; a verification step rewrites the window's earlier tokens in the running
token tensor (``state.tokens``) before the engine copies it. Observers (the probe) see the target's modules only,
and at a verification step the target's pass runs on the verified context, not the step's: this strategy is not
meant for recording. FLOPs count what runs: the draft's transformer and head at draft steps (under the same
``encoder``/``decoder``/``head`` components), plus, at verification steps, the target's pass over the verified
context and its head over the window. ``acceptance`` lists, per verification, the window and accepted counts.

The strategy holds a model, so it is built directly (``SpeculativeStrategy(draft, num_draft=32)``) and not
registered: every registered strategy must run with its default options, and there is no default draft.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .._config import check_ints
from ..engine.strategy import FullStrategy, StepPlan, Strategy, count_blocks, count_embeddings, sample_head
from ..engine.cost import head_eval_flops
from ..models.checkpoints import load_model

__all__ = ["SpeculativeConfig", "SpeculativeStrategy", "acceptance_ratio", "residual_sample", "speculative_schedule"]

ROLES = ("target", "draft", "verify")


def speculative_schedule(num_iter: int, num_draft: int, prefill_ratio: float) -> list[str]:
    """Role of every step of a ``num_iter``-step run: ``"target"`` (pre-fill: an ordinary step of the target),
    ``"draft"`` (a draft step) or ``"verify"`` (a draft step followed by the target's verification), as
    ``SpecDecodeRunner.run`` decides them (``step <= num_iter * prefill_ratio``; ``step % num_draft == 0`` and not
    step 0, or the last step)."""
    for name, value in (("num_iter", num_iter), ("num_draft", num_draft)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative schedule {name} must be a positive integer, got {value!r}")
    milestone = num_iter * prefill_ratio
    roles = []
    for step in range(num_iter):
        if step <= milestone:
            roles.append("target")
        elif (step % num_draft == 0 and step != 0) or step == num_iter - 1:
            roles.append("verify")
        else:
            roles.append("draft")
    return roles


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Options of :class:`SpeculativeStrategy` (see the module docstring for where each value comes from).

    num_draft : verify every ``num_draft`` steps (and at the last); required, the public sources use 4 to 32.
    prefill_ratio : in [0, 1]: steps ``<= num_iter * prefill_ratio`` are the target's own (1: every step, ``full``).
    inner_temperature : > 0, divides the standardised distances in the acceptance ratio (the code's 42).
    max_resample : rounds of the replacement sampler before a token is left at zero (the code's 100).
    """
    num_draft: int | None = None
    prefill_ratio: float = 0.05
    inner_temperature: float = 42.0
    max_resample: int = 100

    def __post_init__(self):
        if self.num_draft is None:
            raise ValueError("speculative num_draft must be set: it has no default (the released notebook uses 4, "
                             "the runner's default is 8, the paper's headline speed-up is at 32)")
        check_ints("speculative", self, (("num_draft", 1), ("max_resample", 1)))
        r = self.prefill_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"speculative prefill_ratio must be a number in [0, 1], got {r!r}")
        t = self.inner_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or not math.isfinite(t):
            raise ValueError(f"speculative inner_temperature must be a positive number, got {t!r}")


def acceptance_ratio(x, mean_q, std_q, logstd_q, mean_p, std_p, logstd_p, inner_temperature: float):
    """The code's acceptance ratio of draft tokens ``x`` [N, C] (``DistributionProcessor.judge_accept``).

    ``*_q`` describe the draft, ``*_p`` the target: ``mean``/``std`` of the last reverse step [N, C], ``logstd``
    the sum of ``log std`` over the other reverse steps [N, C]. Returns [N]; a token is kept where it exceeds a
    uniform draw."""
    fixed = torch.exp((logstd_p - logstd_q).sum(-1))
    q_x = torch.exp(-0.5 * (((x - mean_q) / std_q / inner_temperature) ** 2).sum(-1))
    p_x = torch.exp(-0.5 * (((x - mean_p) / std_p / inner_temperature) ** 2).sum(-1))
    return p_x * fixed * std_q.prod(-1) / (q_x * std_p.prod(-1))


def _normal_pdf(x, mean, std):
    dim = x.shape[-1]
    return torch.exp(-0.5 * (((x - mean) / std) ** 2).sum(-1)) / ((2 * math.pi) ** (dim / 2) * std.prod(-1))


def residual_sample(mean_q, std_q, logstd_q, mean_p, std_p, logstd_p, generator, max_resample: int = 100):
    """Replacement tokens [N, C] from the code's acceptance-rejection sampler (``sample_distribution``): proposals
    from the target's last step, accepted with probability ``max(0, N_p - N_q / F) / N_p``."""
    fixed = torch.exp((logstd_p - logstd_q).sum(-1))
    done = torch.zeros(mean_p.shape[0], dtype=torch.bool, device=mean_p.device)
    out = torch.zeros_like(mean_p)
    for _ in range(max_resample):
        y = torch.randn(mean_p.shape, generator=generator, device=mean_p.device) * std_p + mean_p
        p = _normal_pdf(y, mean_p, std_p)
        alpha = (p - _normal_pdf(y, mean_q, std_q) / fixed).clamp(min=0) / p
        ok = torch.rand(alpha.shape, generator=generator, device=alpha.device) < alpha
        out[ok] = y[ok]
        done |= ok
        if bool(done.all()):
            break
    return out


class SpeculativeStrategy(Strategy):
    """CSpD: a draft MAR generates, the sampled model (the target) verifies (see the module docstring).

    ``draft`` is a MAR model with the target's token grid, token width and classes, or the path of its checkpoint
    (loaded onto the target's device at the first batch)."""

    name = "speculative"
    Config = SpeculativeConfig

    def __init__(self, draft, **options):
        self.config = SpeculativeConfig(**options)
        if not isinstance(draft, (str, Path, torch.nn.Module)):
            raise ValueError(f"speculative draft must be a MAR model or the path of its checkpoint, got "
                             f"{type(draft).__name__!r}")
        self._draft_source = draft
        self.draft = draft if isinstance(draft, torch.nn.Module) else None
        self._roles: list[str] = []
        self.acceptance: list[dict] = []

    @classmethod
    def exact_options(cls, num_iter):
        return {"prefill_ratio": 1.0}

    def to_dict(self) -> dict:
        src = self._draft_source
        draft = str(src) if not isinstance(src, torch.nn.Module) else getattr(getattr(src, "config", None), "name",
                                                                               type(src).__name__)
        return {**super().to_dict(), "draft": draft}

    def schedule(self, num_iter: int) -> list[str]:
        """Role of every step of a ``num_iter``-step run (:func:`speculative_schedule` with this config)."""
        return speculative_schedule(num_iter, self.config.num_draft, self.config.prefill_ratio)

    # ---- per batch ------------------------------------------------------------------------------------
    def begin(self, model, batch_size, num_iter):
        device = next(model.parameters()).device
        if self.draft is None:
            self.draft = load_model(self._draft_source, device=device)
        d = self.draft
        for attr in ("seq_len", "seq_h", "token_embed_dim", "num_classes"):
            if getattr(d, attr) != getattr(model, attr):
                raise ValueError(f"speculative draft has {attr}={getattr(d, attr)!r} but the target has "
                                 f"{getattr(model, attr)!r}: a draft must share the target's tokens and classes")
        if next(d.parameters()).device != device:
            raise ValueError(f"speculative draft is on {next(d.parameters()).device} but the target on {device}")
        self._roles = self.schedule(num_iter)
        self._noise = self._inter = None        # per-position noises, drawn at the first draft step
        self._verified = None                   # [B, L] tokens unknown at the last verification (or pre-fill)
        self._zt = None                         # the target's decoder output at a verification step
        shape = (batch_size, model.seq_len, model.token_embed_dim)
        self._stats = {k: torch.zeros(shape, device=device) for k in ("mean", "std", "logstd")}

    def is_refresh(self, step: int) -> bool:
        return not self._roles or self._roles[step] == "target"

    # ---- transformer ----------------------------------------------------------------------------------
    def transformer(self, model, state, timer):
        role = self._roles[state.step]
        if role == "target":
            return FullStrategy.transformer(self, model, state, timer)
        d = self.draft
        z = self._forward(d, state.tokens_in, state.mask_in, self._class_embedding(d, state), timer)
        plan = StepPlan(refresh=False, rows={"encoder": [0] * len(model.encoder_blocks),
                                             "decoder": [0] * len(model.decoder_blocks)})
        if role == "verify":                    # the target on the verified context only
            mask = self._verified.repeat(len(state.branches), 1)
            self._zt = self._forward(model, state.tokens_in, mask, state.class_embedding, timer)
            n_enc = model.buffer_size + int((~self._verified[0]).sum())
            plan = StepPlan(refresh=False, computed=state.branches, rows={
                "encoder": [n_enc] * len(model.encoder_blocks),
                "decoder": [model.buffer_size + model.seq_len] * len(model.decoder_blocks)})
        state.outputs.plan = plan
        return z

    @staticmethod
    def _class_embedding(m, state):
        bsz = state.batch_size
        emb = m.class_emb(state.labels) if state.labels is not None else m.fake_latent.repeat(bsz, 1)
        if len(state.branches) == 2:
            emb = torch.cat([emb, m.fake_latent.repeat(bsz, 1)], dim=0)
        return emb

    @staticmethod
    def _forward(m, tokens_in, mask_in, class_embedding, timer):
        """Encoder and decoder of ``m`` on ``tokens_in`` with ``mask_in`` (True = unknown), FLOPs counted."""
        b = tokens_in.shape[0]
        n_enc = m.buffer_size + int((~mask_in[0]).sum())
        n_dec = m.buffer_size + m.seq_len
        with timer("encoder"):
            x = m.forward_mae_encoder(tokens_in, mask_in, class_embedding)
        with timer("decoder"):
            z = m.forward_mae_decoder(x, mask_in)
        count_embeddings(timer, m, b, n_enc)
        count_blocks(timer, m, "encoder", b, n_enc, n_enc, layers=len(m.encoder_blocks))
        count_blocks(timer, m, "decoder", b, n_dec, n_dec, layers=len(m.decoder_blocks))
        return z

    # ---- head -----------------------------------------------------------------------------------------
    def head_sample(self, model, z, state, rng):
        role = self._roles[state.step]
        if role == "target":
            out = sample_head(model, z, state, rng)
            self._verified = state.mask_next.clone()
            return out
        diffusion = model.diffloss.diffusion_for(None)
        if self._noise is None:
            b, n, c = state.tokens.shape
            dev = state.tokens.device
            self._noise = torch.randn(b, n, c, generator=rng.noise, device=dev)
            self._inter = torch.randn(b, n, diffusion.num_timesteps, c, generator=rng.noise, device=dev)
        sel = state.to_pred.nonzero(as_tuple=True)
        x, mean, std, logstd = self._aligned_head(self.draft.diffloss, z, state, sel, diffusion)
        for key, value in (("mean", mean), ("std", std), ("logstd", logstd)):
            self._stats[key][sel] = value
        plan = state.outputs.ensure_plan()
        plan.head = {"full": diffusion.num_timesteps, "cached": 0}
        if role == "verify":
            x = self._verify(model, state, sel, x, diffusion, rng)
            plan.head = {"full": 2 * diffusion.num_timesteps, "cached": 0}
        return torch.cat([x, x], dim=0) if len(state.branches) == 2 else x

    def _aligned_head(self, diffloss, z, state, sel, diffusion):
        """Sample the tokens at positions ``sel`` from ``z`` [M', D] with the per-position noises; returns the
        conditional rows' tokens, last-step mean and std (times the temperature) and summed log std, each [M, C]."""
        timer = state.outputs.timer
        if timer is not None:
            timer.add_flops("head.linear", diffusion.num_timesteps * head_eval_flops(diffloss.net, z.shape[0]))
        cfg, temperature = state.cfg_iter, state.temperature
        use_cfg = not cfg == 1.0
        noise, inter = self._noise[sel], self._inter[sel]             # [M, C], [M, T, C]
        x = torch.cat([noise, noise], dim=0) if use_cfg else noise
        logstd = torch.zeros_like(x)
        mean0 = std0 = None
        for i in reversed(range(diffusion.num_timesteps)):
            t = torch.full((x.shape[0],), i, dtype=torch.long, device=z.device)
            tm = diffusion.model_timesteps(t)
            out = diffloss.net.forward_with_cfg(x, tm, z, cfg) if use_cfg else diffloss.net(x, tm, z)
            step_noise = torch.cat([inter[:, i], inter[:, i]], dim=0) if use_cfg else inter[:, i]
            mean, log_var, _ = diffusion.p_mean_variance(out, x, t, diffloss.clip_denoised)
            if i == 0:
                mean0, std0 = mean, torch.exp(0.5 * log_var) * temperature
            else:
                logstd = logstd + 0.5 * log_var
            x = diffusion.p_sample(out, x, t, step_noise, temperature, diffloss.clip_denoised)
        m = noise.shape[0]
        return x[:m], mean0[:m], std0[:m], logstd[:m]

    def _verify(self, model, state, sel, drafted, diffusion, rng):
        """The target's verification of the window; rewrites its earlier tokens in ``state.tokens`` and returns the
        step's own tokens [M, C]."""
        last = state.step >= state.num_iter - 1
        window = self._verified.clone() if last else self._verified & ~state.mask_next
        tokens = state.tokens.clone()
        tokens[sel] = drafted
        wsel = window.nonzero(as_tuple=True)
        zt = self._zt[window.repeat(len(state.branches), 1).nonzero(as_tuple=True)]
        _, mean_p, std_p, logstd_p = self._aligned_head(model.diffloss, zt, state, wsel, diffusion)
        q = {k: v[wsel] for k, v in self._stats.items()}
        x = tokens[wsel]
        ratio = acceptance_ratio(x, q["mean"], q["std"], q["logstd"], mean_p, std_p, logstd_p,
                                 self.config.inner_temperature)
        keep = ratio > torch.rand(ratio.shape, generator=rng.noise, device=ratio.device)
        if not bool(keep.all()):
            repl = residual_sample(q["mean"], q["std"], q["logstd"], mean_p, std_p, logstd_p, rng.noise,
                                   self.config.max_resample)
            x = torch.where(keep.unsqueeze(-1), x, repl)
        tokens[wsel] = x
        state.tokens[window] = tokens[window]          # the window's earlier tokens, in the running tensor
        self.acceptance.append({"step": state.step, "window": int(window.sum()), "accepted": int(keep.sum())})
        self._verified = state.mask_next.clone()
        self._zt = None
        return tokens[sel]
