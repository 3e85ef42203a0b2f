"""compose's head side (issue 17, item 2): a head-step schedule (DiSA's) beside LazyMAR's head cache and the token
side, its exactness contract, and the head cache running over the schedule's respaced steps."""
import pytest
import torch

import mar_probe
from mar_probe import strategies
from mar_probe.models.diffusion import GaussianDiffusion
from mar_probe.strategies.compose import HEAD_SIDE_OPTIONS
from mar_probe.strategies.head_schedule import DiSASchedule, DiSAScheduleConfig

NUM_ITER = 8
LABELS = [1, 7]
OWN = 10                                                    # mar_tiny's head steps
SCHEDULE = {"upper": OWN, "lower": 2, "clip_timestep": None}
KS = [10, 8, 7, 6, 5, 4, 3, 2]                             # linear 10 -> 2 over 8 steps (tests/test_disa.py)


def _run(model, strategy, observers=(), **kw):
    kw = dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=3), **kw)
    return mar_probe.sample(model, LABELS, strategy=strategy, observers=list(observers), **kw)


def _exact_tokens(name):
    """A token policy's recompute-everything options, less those of its own head (compose refuses them)."""
    opts = strategies._REGISTRY[name].exact_options(NUM_ITER)
    return {k: v for k, v in opts.items() if k not in HEAD_SIDE_OPTIONS.get(name, ())}


def _compose(name="marche", **opts):
    opts.setdefault("token_opts", _exact_tokens(name))
    return strategies.create("compose", tokens=name, **opts)


def _same(a, b):
    assert torch.equal(a.tokens, b.tokens)
    assert a.cost["totals"]["flops"] == b.cost["totals"]["flops"]


class _Head:
    """Per step: the plan, and the head's network evaluations (calls of its input projection, one per evaluation
    whatever the cache reuses)."""

    def __init__(self, model):
        self.plans, self.evals, self._n = [], [], 0
        self._hook = model.diffloss.net.input_proj.register_forward_hook(lambda *a: self._count())

    def _count(self):
        self._n += 1

    def step_begin(self, state):
        self._n = 0

    def step_end(self, state, sampled):
        self.plans.append(state.outputs.plan)
        self.evals.append(self._n)

    def close(self):
        self._hook.remove()


@pytest.fixture(scope="module")
def full(deep_tiny):
    return _run(deep_tiny, "full")


# ---- exactness (item 3) -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["marche", "recap", "lazymar"])
@pytest.mark.parametrize("schedule", [None, "own"])
def test_everything_recomputing_equals_full(deep_tiny, full, name, schedule):
    """Token policy recomputing, head_interval=1, no schedule or one of the head's own steps without clamp."""
    opts = dict(head_schedule="disa", head_opts={"upper": None, "lower": None, "clip_timestep": None}) \
        if schedule else {}
    _same(_run(deep_tiny, _compose(name, head_interval=1, **opts)), full)


@pytest.mark.parametrize("head_opts", [SCHEDULE, {}, {"upper": 9, "lower": 3, "schedule": "cosine"}])
def test_schedule_alone_equals_disa(deep_tiny, head_opts):
    """compose with only a DiSA schedule (tokens recomputing, no head cache) is disa, tokens and FLOPs."""
    mine, theirs = _Head(deep_tiny), _Head(deep_tiny)
    try:
        composed = _run(deep_tiny, _compose(head_cache=False, head_schedule="disa", head_opts=head_opts),
                        observers=[mine])
        disa = _run(deep_tiny, strategies.create("disa", **head_opts), observers=[theirs])
    finally:
        mine.close(), theirs.close()
    _same(composed, disa)
    assert [p.head_steps for p in mine.plans] == [p.head_steps for p in theirs.plans]
    assert mine.evals == theirs.evals == [p.head["full"] for p in theirs.plans]


def test_head_cache_alone_equals_lazymar_head_cache(deep_tiny, full):
    lazy = strategies.create("lazymar", token_cache=False, condition_cache=False, refresh_interval=1, head_interval=3)
    composed = _run(deep_tiny, _compose(head_interval=3))
    _same(composed, _run(deep_tiny, lazy))
    assert not torch.equal(composed.tokens, full.tokens)


@pytest.mark.parametrize("condition_cache", [True, False])
def test_lazymar_is_its_token_policy_with_the_condition_and_head_caches(deep_tiny, condition_cache):
    """lazymar is built of parts (issue 18 item 4): compose's condition cache and head cache (at lazymar's defaults)
    around lazymar's token cache equal lazymar bit for bit, with or without the condition cache."""
    composed = strategies.create("compose", tokens="lazymar", condition_cache=condition_cache)
    _same(_run(deep_tiny, composed), _run(deep_tiny, strategies.create("lazymar", condition_cache=condition_cache)))
    assert type(composed.tokens).__name__ == "LazyMARTokens"
    policy = composed.to_dict()["token_strategy"]
    assert "head_interval" not in policy and "condition_cache" not in policy    # parts compose holds itself


# ---- the head cache over the schedule's respaced steps --------------------------------------------------------
def test_head_cache_at_interval_one_under_a_schedule_is_the_scheduled_head(deep_tiny):
    plain = _run(deep_tiny, _compose(head_cache=False, head_schedule="disa", head_opts=SCHEDULE))
    cached = _run(deep_tiny, _compose(head_interval=1, head_schedule="disa", head_opts=SCHEDULE))
    _same(cached, plain)


@pytest.mark.parametrize("num_iter, head_opts, interval, ts", [
    (NUM_ITER, SCHEDULE, 3, KS),
    (4, {}, 7, [48, 34, 20, 5]),             # 50 -> 5 clamped at 950: 50 steps keep 48 timesteps, 35 keep 34
])
@pytest.mark.parametrize("batched", [False, True])
def test_head_cache_runs_fewer_evaluations_over_the_respaced_steps(deep_tiny, num_iter, head_opts, interval, ts,
                                                                   batched):
    """Each step evaluates the net once per respaced reverse index (T of the step's process), in full at
    i == T-1 and i % interval == 0 and cached in between: a step with cached evaluations costs fewer head FLOPs than
    disa alone's."""
    opts = dict(head_schedule="disa", head_opts=head_opts)
    cache, alone = _Head(deep_tiny), _Head(deep_tiny)
    try:
        res = _run(deep_tiny, _compose(head_interval=interval, head_batch_modulation=batched, **opts),
                   observers=[cache], num_iter=num_iter)
        disa = _run(deep_tiny, _compose(head_cache=False, **opts), observers=[alone], num_iter=num_iter)
    finally:
        cache.close(), alone.close()
    steps = DiSASchedule(DiSAScheduleConfig(**head_opts)).steps(deep_tiny, num_iter)
    clip = DiSAScheduleConfig(**head_opts).clip_timestep
    assert [GaussianDiffusion(str(k), clip_timestep=clip).num_timesteps for k in steps] == ts
    assert [p.head_steps for p in cache.plans] == steps
    want_full = [sum(1 for i in range(t) if i == t - 1 or i % interval == 0) for t in ts]
    assert [p.head for p in cache.plans] == [{"full": f, "cached": t - f} for f, t in zip(want_full, ts)]
    assert cache.evals == alone.evals == ts                                  # one evaluation per reverse index
    assert all(p.head == {"full": t, "cached": 0} for p, t in zip(alone.plans, ts))
    head = [[s["flops"]["head.linear"] for s in r.cost["steps"]] for r in (res, disa)]
    assert all(c < a for c, a, p in zip(*head, cache.plans) if p.head["cached"]) and sum(head[0]) < sum(head[1])
    assert torch.isfinite(res.tokens).all() and not torch.equal(res.tokens, disa.tokens)


def test_time_tables_are_made_once_per_process_and_batch(deep_tiny):
    """Under a schedule the head cache keeps one timestep table per respaced process with cached evaluations (two
    here: 10 steps, then 4), each made once per batch, so its FLOPs are counted once."""
    strategy = _compose(head_interval=3, head_schedule="disa",
                        head_opts={"schedule": "two-stage", "upper": OWN, "lower": 4, "clip_timestep": None})
    class Tables:
        seen = []

        def step_end(self, state, sampled):
            self.seen.append([d.num_timesteps for d, _ in strategy.head._tables.values()])

    _run(deep_tiny, strategy, observers=[Tables()])
    assert Tables.seen == [[10]] * 4 + [[10, 4]] * 4                          # kept across steps, not remade
    strategy.begin(deep_tiny, 2, NUM_ITER)
    assert not strategy.head._tables


# ---- token policies with a schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, token_opts, condition", [
    ("marche", {"budget": 20}, True),
    ("recap", {"warmup_steps": 2}, True),
    ("lazymar", {"warmup_steps": 2, "refresh_interval": 3}, True),
])
def test_token_policies_compose_with_a_schedule_and_the_head_cache(deep_tiny, name, token_opts, condition):
    obs = _Head(deep_tiny)
    try:
        res = _run(deep_tiny, strategies.create("compose", tokens=name, token_opts=token_opts,
                                                condition_cache=condition, head_interval=3, head_schedule="disa",
                                                head_opts=SCHEDULE), observers=[obs])
    finally:
        obs.close()
    assert torch.isfinite(res.tokens).all()
    assert [p.head_steps for p in obs.plans] == KS                           # recap's shorter head never applies
    assert obs.evals == KS and not all(p.refresh for p in obs.plans)
    assert res.settings["strategy"]["head_schedule_config"] == {"name": "disa", "upper": OWN, "lower": 2,
                                                                "schedule": "linear", "clip_timestep": None}


def test_command_line_text_parses_into_the_typed_options():
    pairs = strategies.parse_options("compose", ["head_schedule=disa", "head_opts=upper=none;lower=4;schedule=cosine"])
    text = strategies.create("compose", **pairs)
    typed = strategies.create("compose", head_schedule="disa", head_opts={"upper": None, "lower": 4,
                                                                          "schedule": "cosine"})
    assert text.config == typed.config and typed.config.head_opts == {"upper": None, "lower": 4, "schedule": "cosine"}
    assert strategies.parse_options("compose", ["head_schedule=none"]) == {"head_schedule": None}


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(head_schedule="anneal"), r"compose head_schedule must be one of \('disa',\) or None, got 'anneal'"),
    (dict(head_schedule="disa", head_opts={"uper": 3}),
     r"strategy 'disa' has no option 'uper'; valid options: upper: int \| None = 50, lower: int \| None = 5"),
    (dict(head_schedule="disa", head_opts="uper=3"), r"strategy 'disa' has no option 'uper'; valid options: upper"),
    (dict(head_schedule="disa", head_opts={"lower": 1}), r"disa lower must be an integer >= 2 .* or None, got 1"),
    (dict(head_schedule="disa", head_opts={"lower": 9, "upper": 3}), r"disa lower=9 exceeds upper=3"),
    (dict(head_schedule="disa", head_opts={"schedule": "exp"}),
     r"disa schedule must be one of \('linear', 'cosine', 'two-stage', 'constant'\), got 'exp'"),
    (dict(head_schedule="disa", head_opts=[("upper", 3)]), r"compose head_opts must be a dict of 'disa' options"),
    (dict(head_opts={"upper": 9}), r"compose head_opts \{'upper': 9\} are given without a head_schedule "
                                   r"\(one of \('disa',\)\)"),
    (dict(tokens="recap", token_opts={"head_fraction": 0.5}),
     r"compose token_opts option 'head_fraction'=0.5 is 'recap''s own head, which compose never calls .* "
     r"head_schedule, head_opts"),
    (dict(tokens="lazymar", token_opts="head_interval=3"),
     r"compose token_opts option 'head_interval'=3 is 'lazymar''s own head"),
    (dict(tokens="lazymar", token_opts={"condition_cache": False}),
     r"compose token_opts option 'condition_cache'=False is 'lazymar''s own condition cache, which compose never "
     r"uses; set compose's condition_cache and condition_warmup instead"),
    (dict(tokens="disa", condition_cache=False),
     r"compose tokens='disa' does not expose its decoder hidden state; expected .* 'marche', 'recap' or 'lazymar'"),
])
def test_bad_options_are_refused_naming_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        strategies.create("compose", **options)


def test_schedule_outside_the_heads_steps_is_refused_before_sampling(deep_tiny):
    with pytest.raises(ValueError, match=r"disa head-step schedule 1200->5 is outside the head's steps: upper=1200"):
        _run(deep_tiny, _compose(head_schedule="disa", head_opts={"upper": 1200}))
