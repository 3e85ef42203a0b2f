"""The sampling engine: MAR's ``sample_tokens`` loop as an explicit sequence of per-step states.

Each step is planned (:func:`plan_step`) into a :class:`StepState` that says everything about the step —
which tokens are known, which are generated, the CFG scale, the branch layout and where every encoder row
sits — then a :class:`~mar_probe.engine.strategy.Strategy` computes the transformer output and the head's
tokens, and observers (the probe) see the state before and after. With ``rng="official"`` random numbers are
drawn exactly as the official code draws them from its global generators after
``np.random.seed(seed); torch.manual_seed(seed)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..vocab import branches_for
from .sampling import CFG_SCHEDULES, RNG_MODES
from .strategy import FullStrategy, StepPlan, Strategy, Timer

__all__ = ["CFG_SCHEDULES", "RNG_MODES", "SampleRNG", "Sampler", "StepOutputs", "StepState", "cfg_scale",
           "mask_length", "plan_step"]


@dataclass
class SampleRNG:
    """Random sources of one sampling run: generation orders and head noise.

    ``own`` and ``official`` draw the head's noise of every step from one stream, so a strategy that draws less
    at one step (fewer reverse steps: ``disa``) shifts the noise of every later step and its images are new
    samples rather than approximations of ``full``'s. ``stepwise`` gives each step's head two generators of its
    own, seeded from (seed, step): the initial noise x_T of a step is the same whatever any strategy drew before
    or draws within the step (issue 17: a paired judgement of head-step schedules)."""
    mode: str
    orders_np: np.random.RandomState | np.random.Generator
    init_noise: torch.Generator
    noise: torch.Generator
    seed: int = 0

    @classmethod
    def create(cls, seed: int, mode: str, device: torch.device) -> SampleRNG:
        if mode not in RNG_MODES:
            raise ValueError(f"unknown rng mode {mode!r}; expected one of {RNG_MODES!r}")
        cpu = torch.Generator("cpu").manual_seed(seed)
        dev = cpu if device.type == "cpu" else torch.Generator(device).manual_seed(seed)
        if mode == "official":  # global np.random.shuffle; CPU randn moved to the device; randn_like on it
            return cls(mode, np.random.RandomState(seed), cpu, dev, seed)
        if mode == "stepwise":  # x_T and the reverse steps' noise apart, so the reverse steps never shift x_T
            return cls(mode, np.random.default_rng(seed), torch.Generator(device), torch.Generator(device), seed)
        return cls(mode, np.random.default_rng(seed), dev, dev, seed)

    def begin_step(self, step: int) -> None:
        """Called by the sampler before each step: ``stepwise`` reseeds the head's generators from (seed, step)
        (numpy's SeedSequence, so nearby seeds and steps give unrelated streams); the other modes keep theirs."""
        if self.mode != "stepwise":
            return
        init_seed, noise_seed = np.random.SeedSequence([self.seed, step]).generate_state(2, dtype=np.uint64)
        self.init_noise.manual_seed(int(init_seed))
        self.noise.manual_seed(int(noise_seed))

    def orders(self, bsz: int, seq_len: int, device) -> torch.Tensor:
        """Generation orders [B, L]: a random permutation of token positions per image."""
        rows = []
        for _ in range(bsz):
            order = np.arange(seq_len)
            self.orders_np.shuffle(order)
            rows.append(order)
        return torch.as_tensor(np.array(rows), dtype=torch.long, device=device)


@dataclass
class StepOutputs:
    """What the computation of one step reports, as typed fields (issue 18: was the ``extras`` dict).

    One object per step, shared by reference with the restricted views a composed strategy makes of the step
    (:func:`~mar_probe.strategies.compose.cond_only`), so the plan a token policy writes lands in the step's.
    """
    plan: StepPlan | None = None   # which rows, branches and head evaluations the strategy computed
    timer: Timer | None = None     # the sampler's: strategies count their FLOPs into it
    cost: dict | None = None       # after the step: its seconds and FLOPs per component (Timer.steps[-1])

    def ensure_plan(self) -> StepPlan:
        """The step's plan, a full-refresh one if the transformer part set none (a head-only strategy)."""
        if self.plan is None:
            self.plan = StepPlan(refresh=True)
        return self.plan


@dataclass
class StepState:
    """Everything about one sampling step. Masks are bool with True = token unknown.

    ``tokens_in``, ``mask_in`` and ``class_embedding`` have the branch layout ``[cond; uncond]`` (B' = B x
    number of branches). ``enc_positions`` [B', Nenc] gives, for each encoder row, its index in the
    ``[buffer; tokens]`` sequence (buffer rows are 0..S-1, token t is S+t).
    """
    step: int
    num_iter: int
    tokens: torch.Tensor          # [B, L, C] tokens known before the step (zeros where unknown)
    mask: torch.Tensor            # [B, L] unknown before the step
    mask_next: torch.Tensor       # [B, L] still unknown after the step
    to_pred: torch.Tensor         # [B, L] generated at this step
    orders: torch.Tensor          # [B, L] generation order
    labels: torch.Tensor | None   # [B]
    branches: tuple[str, ...]
    cfg_iter: torch.Tensor | float
    temperature: float
    mask_len: int                 # number of tokens still unknown after the step (official's mask_len)
    tokens_in: torch.Tensor = None
    mask_in: torch.Tensor = None
    class_embedding: torch.Tensor = None
    enc_positions: torch.Tensor = None
    outputs: StepOutputs = field(default_factory=StepOutputs)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def to_pred_branches(self) -> torch.Tensor:
        """[B', L] generated tokens in the branch layout."""
        return self.to_pred.repeat(len(self.branches), 1)


def mask_length(step: int, num_iter: int, seq_len: int, num_unknown: int) -> int:
    """Tokens left unknown after ``step``: cosine schedule, at least one generated per step."""
    ratio = np.cos(math.pi / 2.0 * (step + 1) / num_iter)
    target = float(np.float32(np.floor(seq_len * ratio)))
    return int(max(1.0, min(num_unknown - 1.0, target)))


def cfg_scale(cfg: float, schedule: str, seq_len: int, mask_len: int) -> torch.Tensor | float:
    """CFG scale of a step (Muse's linear ramp or constant), in the reference's float32 arithmetic."""
    if schedule == "linear":
        t = torch.tensor([float(mask_len)], dtype=torch.float32)
        return 1 + (cfg - 1) * (seq_len - t) / seq_len
    if schedule == "constant":
        return cfg
    raise ValueError(f"unknown cfg schedule {schedule!r}; expected one of {CFG_SCHEDULES!r}")


def plan_step(model, step: int, num_iter: int, tokens, mask, orders, labels, *, cfg: float, cfg_schedule: str,
              temperature: float) -> StepState:
    """Plan one step: masks before/after, generated tokens, CFG scale, branch layout and encoder rows."""
    bsz, seq_len = mask.shape
    mask_len = mask_length(step, num_iter, seq_len, int(mask[0].sum()))
    mask_next = torch.zeros_like(mask).scatter(-1, orders[:, :mask_len], True)  # [B, L]
    to_pred = mask if step >= num_iter - 1 else mask & ~mask_next
    scale = cfg_scale(cfg, cfg_schedule, seq_len, mask_len)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(mask.device)
    branches = branches_for(cfg)
    state = StepState(step=step, num_iter=num_iter, tokens=tokens, mask=mask, mask_next=mask_next, to_pred=to_pred,
                      orders=orders, labels=labels, branches=branches, cfg_iter=scale, temperature=temperature,
                      mask_len=mask_len)
    _fill_branch_inputs(model, state)
    return state


def _fill_branch_inputs(model, state: StepState) -> None:
    bsz = state.batch_size
    emb = model.class_emb(state.labels) if state.labels is not None else model.fake_latent.repeat(bsz, 1)
    nb = len(state.branches)
    if nb == 2:
        emb = torch.cat([emb, model.fake_latent.repeat(bsz, 1)], dim=0)
    state.class_embedding = emb                                    # [B', D]
    state.tokens_in = state.tokens.repeat(nb, 1, 1)                # [B', L, C]
    state.mask_in = state.mask.repeat(nb, 1)                       # [B', L]
    keep = torch.cat([torch.ones(bsz * nb, model.buffer_size, dtype=torch.bool, device=state.mask.device),
                      ~state.mask_in], dim=1)                      # [B', S+L]
    pos = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    state.enc_positions = pos[keep].reshape(bsz * nb, -1)          # [B', Nenc]


class Sampler:
    """Runs MAR's generation loop for one batch, delegating each step to a strategy.

    Observers are objects with optional ``step_begin(state)`` and ``step_end(state, sampled)`` methods;
    ``sampled`` is the [M, C] token latents written at the step.
    """

    def __init__(self, model, strategy: Strategy | None = None, observers=(), device=None):
        self.model = model
        self.strategy = strategy or FullStrategy()
        self.observers = list(observers)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.timer = Timer(self.device)

    @torch.no_grad()
    def run(self, labels, rng: SampleRNG, *, num_iter: int, cfg: float, cfg_schedule: str, temperature: float,
            progress: bool = False):
        """Generate one batch; returns (tokens [B, L, C], orders [B, L])."""
        m = self.model
        bsz = labels.shape[0]
        tokens = torch.zeros(bsz, m.seq_len, m.token_embed_dim, device=self.device)
        mask = torch.ones(bsz, m.seq_len, dtype=torch.bool, device=self.device)
        orders = rng.orders(bsz, m.seq_len, self.device)
        num_iter = self.strategy.num_steps(num_iter)
        self.strategy.begin(m, bsz, num_iter)
        for step in tqdm(range(num_iter), disable=not progress, desc="steps", leave=False):
            self.timer.begin_step(step)
            rng.begin_step(step)
            state = plan_step(m, step, num_iter, tokens, mask, orders, labels, cfg=cfg,
                              cfg_schedule=cfg_schedule, temperature=temperature)
            tokens = self.run_step(state, rng)
            mask = state.mask_next
        return tokens, orders

    def run_step(self, state: StepState, rng: SampleRNG) -> torch.Tensor:
        """Compute one step and return the tokens after it [B, L, C]."""
        self._notify("step_begin", state)
        state.outputs.timer = self.timer                               # strategies count FLOPs into it
        z = self.strategy.transformer(self.model, state, self.timer)   # [B', L, D]
        z = z[state.to_pred_branches.nonzero(as_tuple=True)]           # [M', D], row-major as the reference
        head_steps = self.strategy.head_steps(self.model, state)
        if head_steps is not None:                                     # the head's steps at this step (disa)
            state.outputs.ensure_plan().head_steps = head_steps
        with self.timer("head"):
            sampled = self.strategy.head_sample(self.model, z, state, rng)  # [M', C]
        if len(state.branches) == 2:
            sampled, _ = sampled.chunk(2, dim=0)                        # drop the unconditional copies
        tokens = state.tokens.clone()
        tokens[state.to_pred.nonzero(as_tuple=True)] = sampled
        if self.timer.steps:
            state.outputs.cost = self.timer.steps[-1]                  # this step's seconds and FLOPs
        self._notify("step_end", state, sampled)
        return tokens

    def _notify(self, event: str, *args) -> None:
        for obs in self.observers:
            fn = getattr(obs, event, None)
            if fn is not None:
                fn(*args)
