"""Shadow mode, the oracle and adaptive MARché policies, and composed strategies."""
import numpy as np
import pytest
import torch

import mar_probe
from mar_probe import strategies
from mar_probe.probe.shadow import sample_with_shadow
from mar_probe.strategies.reference import reference_trace

NUM_ITER = 6
LABELS = [1, 7]
ERRORS = ("enc_kv_err", "dec_kv_err", "enc_resid_err", "dec_resid_err", "z_err")


def _shadow(model, strategy, **kw):
    kw = dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=3), **kw)
    return sample_with_shadow(model, LABELS, strategy=strategy, **kw)


def _max(ds, var):
    return float(np.nanmax(ds[var].values))


@pytest.mark.parametrize("name", strategies.available())
def test_shadow_error_is_exactly_zero_when_everything_is_recomputed(deep_tiny, name):
    exact = strategies._REGISTRY[name].exact_options(4)
    res, ds = _shadow(deep_tiny, strategies.create(name, **exact), num_iter=4)
    for var in ERRORS:
        assert _max(ds, var) == 0.0, var
    assert ds.refresh.values.all()
    assert ds["z_err"].notnull().sum() == 2 * 2 * 64                       # every token generated once, 2 branches
    assert ds["dec_kv_err"].notnull().all()                                # the decoder sees every row


def test_shadow_error_grows_between_refreshes_and_vanishes_at_refresh(deep_tiny):
    _, ds = _shadow(deep_tiny, strategies.create("marche", budget=20), num_iter=8)
    per_step = ds["dec_kv_err"].mean(("sample", "branch", "dec_layer", "token")).values
    refresh = ds.refresh.values[0]
    assert refresh.tolist() == [True, False, False, True, False, False, True, False]
    assert (per_step[refresh] == 0).all() and (per_step[~refresh] > 1e-3).all()
    assert per_step[2] > per_step[1] and per_step[5] > per_step[4]           # drift accumulates until a refresh
    # full decoder layers only inherit the encoder's rounding (cache-aware attention); cached layers drift
    dec = ds["dec_kv_err"].sel(step=1).max(("sample", "branch", "token")).values
    assert dec[:2].max() < 1e-5 and (dec[2:] > 1e-2).all()
    assert ds["dec_active"].sel(step=1).sum("token").values.tolist() == [[20, 20]] * 2


def test_shadow_of_derived_branch_has_no_kv_error_but_a_z_error(deep_tiny):
    _, ds = _shadow(deep_tiny, strategies.create("lazymar", warmup_steps=2, refresh_interval=3))
    cached = ~ds.refresh.values[0]
    unc = ds["dec_kv_err"].sel(branch="uncond")
    assert unc.isel(step=np.flatnonzero(cached)).isnull().all()             # derived: used no K/V
    assert (ds["z_err"].sel(branch="uncond").isel(step=np.flatnonzero(cached)).max("token") > 0).all()


def test_shadow_does_not_change_the_samples_or_costs(deep_tiny):
    plain = mar_probe.sample(deep_tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=3, strategy="marche")
    res, _ = _shadow(deep_tiny, "marche")
    assert torch.equal(plain.tokens, res.tokens)
    assert plain.cost["totals"]["flops"] == res.cost["totals"]["flops"]


def test_reference_trace_equals_the_model_forward(deep_tiny):
    seen = []

    class Grab:
        def step_begin(self, state):
            if state.step == 1:
                seen.append(reference_trace(deep_tiny, state))

        def step_end(self, state, sampled):
            pass

    obs = Grab()
    mar_probe.sample(deep_tiny, LABELS, num_iter=3, cfg=3.0, seed=0, observers=[obs])
    ref = seen[0]
    assert len(ref.encoder.k) == 4 and len(ref.decoder.k) == 5
    assert ref.z.shape == (4, 64, 32) and ref.decoder.k[0].shape == (4, 2, 68, 16)


# ---- oracle and adaptive policies ------------------------------------------------------------------------
class _Plans:
    def __init__(self):
        self.plans = []

    def step_end(self, state, sampled):
        self.plans.append(state.outputs.plan)


def test_oracle_selects_the_rows_of_largest_true_drift(deep_tiny):
    """At the first cached step the oracle's drift ranking is the shadow's K/V error of the cached layers."""
    obs = _Plans()
    _, ds = _shadow(deep_tiny, strategies.create("marche", selection="oracle", budget=24), observers=[obs])
    att_obs = _Plans()
    _, att = _shadow(deep_tiny, strategies.create("marche", selection="attention", budget=24), observers=[att_obs])
    act, att_act = obs.plans[1].active["decoder"], att_obs.plans[1].active["decoder"]
    assert act.sum(1).tolist() == [24] * 4 and not torch.equal(act, att_act)
    # faithfulness at the same budget: the oracle's cached K/V drift no more than attention selection's
    cached_steps = np.flatnonzero(~ds.refresh.values[0])
    err = float(ds["dec_kv_err"].isel(step=cached_steps).mean())
    assert err <= float(att["dec_kv_err"].isel(step=cached_steps).mean())


def test_drift_triggered_refresh_follows_the_threshold(deep_tiny):
    def refreshes(threshold, period):
        obs = _Plans()
        mar_probe.sample(deep_tiny, LABELS, num_iter=8, cfg=3.0, seed=3, observers=[obs],
                         strategy=strategies.create("marche", refresh_threshold=threshold, refresh_period=period))
        return [p.refresh for p in obs.plans]
    assert refreshes(1e9, 8) == [True] + [False] * 7                       # never triggered, cap not reached
    assert refreshes(1e9, 3) == [True, False, False, True, False, False, True, False]   # the cap alone
    assert refreshes(1e-9, 8) == [True, False] + [True, False] * 3          # triggered after each cached step


def test_adaptive_budget_covers_the_requested_score_mass(deep_tiny):
    from mar_probe.strategies.marche import _mass_count
    scores = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]])
    assert _mass_count(scores, 0.5) == 1 and _mass_count(scores, 0.8) == 2 and _mass_count(scores, 1.0) == 4
    fixed, adaptive = _Plans(), _Plans()
    _shadow(deep_tiny, strategies.create("marche", budget=40), observers=[fixed])
    _shadow(deep_tiny, strategies.create("marche", budget=40, refresh_mass=0.3), observers=[adaptive])
    n_fixed = [int(p.active["decoder"][0].sum()) for p in fixed.plans if not p.refresh]
    n_adapt = [int(p.active["decoder"][0].sum()) for p in adaptive.plans if not p.refresh]
    assert n_fixed == [40] * len(n_fixed) and all(a < 40 for a in n_adapt)


@pytest.mark.parametrize("options, match", [
    (dict(refresh_threshold=-1.0), "refresh_threshold must be >= 0"),
    (dict(refresh_mass=1.5), r"refresh_mass must be in \[0, 1\]"),
    (dict(refresh_mass=0.5, selection="random"), "needs a ranking score"),
])
def test_adaptive_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        strategies.create("marche", **options)


# ---- composition -------------------------------------------------------------------------------------------
def test_compose_derives_uncond_between_refreshes_and_caches_the_head(deep_tiny):
    obs = _Plans()
    res, _ = _shadow(deep_tiny, strategies.create("compose", token_opts="budget=20"), observers=[obs])
    for step, plan in enumerate(obs.plans):
        assert plan.refresh == (step % 3 == 0)
        assert plan.computed == (("cond", "uncond") if plan.refresh else ("cond",))
        assert plan.head["cached"] > 0
        if not plan.refresh:
            # cond rows only
            assert plan.active["decoder"].shape[0] == 2 and int(plan.active["decoder"][0].sum()) >= 20
    marche = mar_probe.sample(deep_tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=3,
                              strategy=strategies.create("marche", budget=20))
    assert res.cost["totals"]["flops_total"] < marche.cost["totals"]["flops_total"]
    assert res.settings["strategy"]["token_strategy"]["budget"] == 20


def test_compose_rejects_policies_without_hidden_state():
    with pytest.raises(ValueError, match="does not expose its decoder hidden state.*'marche'"):
        strategies.create("compose", tokens="disa")
    with pytest.raises(ValueError, match="has no option 'budjet'"):
        strategies.create("compose", token_opts="budjet=3")
