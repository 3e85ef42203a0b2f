"""``speculative``: continuous speculative decoding (CSpD) with a draft MAR (mar_probe/strategies/speculative.py)."""
import math

import pytest
import torch
from conftest import perturbed_tiny

import mar_probe
from mar_probe.strategies.speculative import (SpeculativeStrategy, acceptance_ratio, residual_sample,
                                              speculative_schedule)

NUM_ITER = 8
LABELS = [1, 7]


@pytest.fixture(scope="module")
def target():
    """A tiny target whose transformer dominates its cost (as MAR-H's does), so that a smaller draft saves FLOPs."""
    return perturbed_tiny(encoder_embed_dim=64, decoder_embed_dim=64, encoder_num_heads=4, decoder_num_heads=4,
                          encoder_depth=4, decoder_depth=4)


@pytest.fixture(scope="module")
def draft():
    return perturbed_tiny(seed=2)                                    # mar_tiny: 2+2 blocks of width 32


def _run(model, strategy, **kw):
    return mar_probe.sample(model, LABELS, **dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=3), **kw), strategy=strategy)


def _roles(roles, name):
    return [i for i, r in enumerate(roles) if r == name]


# ---- schedule ---------------------------------------------------------------------------------------------------
def test_schedule_golden_values():
    roles = speculative_schedule(64, 32, 0.05)                       # the paper's headline draft length, 5% pre-fill
    assert _roles(roles, "target") == [0, 1, 2, 3] and _roles(roles, "verify") == [32, 63]
    assert _roles(roles, "draft") == [s for s in range(4, 63) if s != 32]
    roles = speculative_schedule(256, 4, 0.05)                       # the released notebook's settings
    assert _roles(roles, "target") == list(range(13))                # steps <= 12.8
    assert _roles(roles, "verify") == list(range(16, 256, 4)) + [255]
    roles = speculative_schedule(8, 8, 0.15)                         # the runner's defaults on 8 steps
    assert roles == ["target", "target"] + ["draft"] * 5 + ["verify"]
    assert speculative_schedule(10, 3, 0.0) == ["target", "draft", "draft", "verify", "draft", "draft", "verify",
                                                "draft", "draft", "verify"]
    assert set(speculative_schedule(5, 2, 1.0)) == {"target"}


# ---- the acceptance rule ----------------------------------------------------------------------------------------
def test_acceptance_ratio_golden_value():
    one = torch.ones(1, 1)
    x, mq, sq, mp, sp = 0 * one, 0 * one, one, one, 2 * one
    r = acceptance_ratio(x, mq, sq, 0.3 * one, mp, sp, 0.1 * one, inner_temperature=1.0)
    assert r.item() == pytest.approx(math.exp(-0.5 * 0.25) * math.exp(-0.2) * 1 / 2)
    r = acceptance_ratio(x, mq, sq, 0.3 * one, mp, sp, 0.1 * one, inner_temperature=42.0)
    assert r.item() == pytest.approx(math.exp(-0.5 * (0.5 / 42) ** 2) * math.exp(-0.2) / 2)
    same = acceptance_ratio(x.expand(3, 4), mq.expand(3, 4), sq.expand(3, 4), one.expand(3, 4), mq.expand(3, 4),
                            sq.expand(3, 4), one.expand(3, 4), 42.0)
    assert torch.equal(same, torch.ones(3))                          # identical distributions: always kept


def test_residual_sample_draws_where_the_target_exceeds_the_draft():
    g = torch.Generator().manual_seed(0)
    n = 4000
    zero, one = torch.zeros(n, 1), torch.ones(n, 1)
    y = residual_sample(zero - 2, one, zero, zero, one, zero, g)      # draft N(-2, 1), target N(0, 1)
    assert (y != 0).all() and abs(y.mean() - 0.4648) < 0.05          # the mean of max(0, p - q), normalised
    far = residual_sample(zero, one * 1e-3, zero, zero, one * 1e-3, zero, g, max_resample=3)
    assert (far == 0).all()                                           # p == q: never accepted, left at zero


# ---- the strategy -----------------------------------------------------------------------------------------------
def test_prefill_everything_equals_full_exactly(target, draft):
    full = _run(target, "full")
    res = _run(target, SpeculativeStrategy(draft, num_draft=4, **SpeculativeStrategy.exact_options(NUM_ITER)))
    assert torch.equal(res.tokens, full.tokens)
    assert res.cost["totals"]["flops"] == full.cost["totals"]["flops"]


def test_runs_deterministically_verifies_every_drafted_token_and_counts_what_it_computes(target, draft):
    strat = SpeculativeStrategy(draft, num_draft=4, prefill_ratio=0.0)
    assert strat.schedule(NUM_ITER) == ["target", "draft", "draft", "draft", "verify", "draft", "draft", "verify"]
    res = _run(target, strat)
    again = _run(target, SpeculativeStrategy(draft, num_draft=4, prefill_ratio=0.0))
    assert torch.isfinite(res.tokens).all() and torch.equal(res.tokens, again.tokens)
    assert res.settings["strategy"]["name"] == "speculative"
    full = _run(target, "full")
    assert not torch.equal(res.tokens, full.tokens)
    # every token drafted after the pre-fill step is verified once, in the windows of steps 4 and 7
    windows = [a["window"] for a in strat.acceptance]
    assert [a["step"] for a in strat.acceptance] == [4, 7] and sum(windows) == 2 * (64 - _prefilled(target))
    assert all(0 <= a["accepted"] <= a["window"] for a in strat.acceptance)
    # FLOPs as computed: a draft step costs what the draft's own full step costs, a pre-fill step the target's
    own_draft, own_target = _run(draft, "full").cost["steps"], full.cost["steps"]
    steps = res.cost["steps"]
    assert steps[0]["flops"] == own_target[0]["flops"]
    for s in (1, 2, 3, 5, 6):
        assert steps[s]["flops"] == own_draft[s]["flops"]
    for s in (4, 7):
        assert steps[s]["flops_total"] > own_draft[s]["flops_total"]
    assert res.cost["totals"]["flops_total"] < full.cost["totals"]["flops_total"]


def _prefilled(model):
    """Tokens the first (pre-fill) step of an 8-step run generates per image (MAR's cosine schedule)."""
    return 64 - int(math.floor(64 * math.cos(math.pi / 2 * 1 / NUM_ITER)))


def test_a_draft_identical_to_the_target_verified_every_step_is_always_accepted(target):
    strat = SpeculativeStrategy(target, num_draft=1, prefill_ratio=0.0)
    _run(target, strat)
    assert [a["step"] for a in strat.acceptance] == list(range(1, NUM_ITER))
    assert all(a["accepted"] == a["window"] for a in strat.acceptance)


@pytest.mark.parametrize("options, match", [
    (dict(), "num_draft must be set"),
    (dict(num_draft=0), "num_draft must be a positive integer, got 0"),
    (dict(num_draft=4, prefill_ratio=1.5), r"prefill_ratio must be a number in \[0, 1\]"),
    (dict(num_draft=4, inner_temperature=0), "inner_temperature must be a positive number"),
    (dict(num_draft=4, max_resample=0), "max_resample must be a positive integer"),
])
def test_bad_options_are_refused(draft, options, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeStrategy(draft, **options)


def test_bad_drafts_are_refused(target):
    with pytest.raises(ValueError, match="draft must be a MAR model or the path"):
        SpeculativeStrategy(3, num_draft=4)
    other = mar_probe.create_model("mar_tiny", vae_embed_dim=3).eval()
    with pytest.raises(ValueError, match="token_embed_dim=3 but the target has 4"):
        _run(target, SpeculativeStrategy(other, num_draft=4))
    with pytest.raises(FileNotFoundError):
        _run(target, SpeculativeStrategy("no/such/draft.pth", num_draft=4))
