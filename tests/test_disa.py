"""``disa`` (diffusion step annealing): exactness, the released code's schedules, fewer head steps, fidelity."""
import json

import numpy as np
import pytest
import torch

import mar_probe
from mar_probe import strategies
from mar_probe.cli import main
from mar_probe.engine.cost import head_eval_flops
from mar_probe.engine.loop import SampleRNG, Sampler
from mar_probe.models.diffusion import GaussianDiffusion
from mar_probe.strategies.disa import DiSAStrategy, annealed_steps

from conftest import perturbed_tiny

NUM_ITER = 8
LABELS = [1, 7, 3]
OWN = 10                                             # mar_tiny's head steps (num_sampling_steps "10")


@pytest.fixture(scope="module")
def tiny():
    return perturbed_tiny()


@pytest.fixture(scope="module")
def full(tiny):
    return mar_probe.sample(tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=5)


def _disa(model, **opts):
    kw = {k: opts.pop(k) for k in ("num_iter", "head_steps") if k in opts}
    kw = dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=5), **kw)
    return mar_probe.sample(model, LABELS, strategy=strategies.create("disa", **opts), **kw)


def _head_flops(res):
    return res.cost["totals"]["flops"]["head.linear"]


def _transformer_flops(res):
    return {k: v for k, v in res.cost["totals"]["flops"].items() if not k.startswith("head.")}


# ---- exactness ----------------------------------------------------------------------------------------------
def test_exact_options_equal_full_bit_for_bit(tiny, full):
    res = _disa(tiny, **DiSAStrategy.exact_options(NUM_ITER))   # upper = lower = the head's own 10, no clamp
    assert torch.equal(res.tokens, full.tokens)
    assert res.cost["totals"]["flops"] == full.cost["totals"]["flops"]
    assert res.settings["strategy"] == {"name": "disa", "upper": None, "lower": None, "schedule": "linear",
                                        "clip_timestep": None}


def test_own_steps_given_as_numbers_and_a_sectioned_head_stay_exact(tiny, full):
    res = _disa(tiny, upper=OWN, lower=OWN, clip_timestep=None)
    assert torch.equal(res.tokens, full.tokens)
    sectioned = mar_probe.sample(tiny, LABELS, num_iter=4, cfg=3.0, seed=5, head_steps="3,3")
    res = _disa(tiny, num_iter=4, head_steps="3,3", **DiSAStrategy.exact_options(4))
    assert torch.equal(res.tokens, sectioned.tokens)                # None is the head's own "3,3" respacing


def test_constant_k_is_the_official_head_with_k_steps(tiny):
    """disa at a constant K equals the full model run with num_sampling_steps=K, tokens and FLOPs."""
    ref = mar_probe.sample(tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=5, head_steps="4")
    for opts in (dict(upper=4, lower=4), dict(upper=9, lower=4, schedule="constant")):
        res = _disa(tiny, clip_timestep=None, **opts)
        assert torch.equal(res.tokens, ref.tokens), opts
        assert res.cost["totals"]["flops"] == ref.cost["totals"]["flops"], opts


# ---- the schedules: golden values of the released code's formulas ----------------------------------------------
@pytest.mark.parametrize("schedule, num_iter, upper, lower, step, expected", [
    ("linear", 64, 50, 5, 0, 50),          # first step: upper
    ("linear", 64, 50, 5, 1, 49),          # 5 + int(62/63 * 45 = 44.29)
    ("linear", 64, 50, 5, 4, 47),          # 5 + int(59/63 * 45 = 42.14)
    ("linear", 64, 50, 5, 32, 27),         # 5 + int(31/63 * 45 = 22.14)
    ("linear", 64, 50, 5, 62, 5),          # 5 + int(1/63 * 45 = 0.71)
    ("linear", 64, 50, 5, 63, 5),          # last step: lower
    ("linear", 16, 80, 5, 4, 59),          # 11/15 * 75 is 55 exactly, float64 gives 54.999...: 5 + 54
    ("linear", 16, 80, 5, 3, 65),          # 5 + int(12/15 * 75 = 60.0, exact in float64)
    ("linear", 16, 80, 5, 5, 55),          # 5 + int(10/15 * 75 = 50.0)
    ("cosine", 64, 50, 5, 0, 50),          # 5 + int((cos 0 + 1)/2 * 45 = 45)
    ("cosine", 64, 50, 5, 16, 43),         # 5 + int((cos(16pi/63) = 0.6982 + 1)/2 * 45 = 38.21)
    ("cosine", 64, 50, 5, 32, 26),         # 5 + int((cos(32pi/63) = -0.0249 + 1)/2 * 45 = 21.94)
    ("cosine", 64, 50, 5, 63, 5),          # cos(pi) = -1
    ("two-stage", 64, 50, 5, 31, 50),      # 31 < 63/2
    ("two-stage", 64, 50, 5, 32, 5),
    ("two-stage", 8, 10, 2, 3, 10),        # 3 < 3.5
    ("two-stage", 8, 10, 2, 4, 2),
    ("constant", 64, 50, 5, 0, 5),         # the code's constant schedule: lower throughout
    ("linear", 1, 50, 5, 0, 50),           # one step (the code divides by zero): upper
    ("cosine", 1, 50, 5, 0, 50),
    ("two-stage", 1, 50, 5, 0, 5),         # 0 < 0/2 is false, as in the code
])
def test_schedule_golden_values(schedule, num_iter, upper, lower, step, expected):
    assert annealed_steps(step, num_iter, upper, lower, schedule) == expected


def test_schedules_run_from_upper_to_lower_without_rising():
    for schedule in ("linear", "cosine", "two-stage"):
        ks = [annealed_steps(s, 64, 50, 5, schedule) for s in range(64)]
        assert ks[0] == 50 and ks[-1] == 5 and all(a >= b for a, b in zip(ks, ks[1:])), schedule
    # linear 50 -> 5 over 64 steps: 64 x 5 + sum_j floor(5j/7), j = 0..63 = 320 + (35 x 36 + 9 x 12 + 45) = 1733
    assert sum(annealed_steps(s, 64, 50, 5) for s in range(64)) == 1733


def test_clip_timestep_merges_the_timesteps_above_950():
    """The DiSA sampler's clamp: 50 respaced steps keep 0..917, 938 and 950 (958, 979, 999 merge): 48 steps."""
    for k, evals in ((5, 5), (10, 10), (50, 48), (100, 96)):
        d = GaussianDiffusion(str(k), clip_timestep=950)
        assert d.num_timesteps == evals and d.timestep_map.max() == 950, k
        assert GaussianDiffusion(str(k)).timestep_map.max() == 999
    assert GaussianDiffusion("50", clip_timestep=950).timestep_map[-3:].tolist() == [917, 938, 950]
    own = GaussianDiffusion("10")
    assert np.array_equal(GaussianDiffusion("10", clip_timestep=None).betas, own.betas)


# ---- the head runs fewer steps --------------------------------------------------------------------------------
class _Plans:
    def __init__(self):
        self.plans = []

    def step_end(self, state, sampled):
        self.plans.append(state.outputs.plan)


def test_plan_calls_and_flops_follow_the_schedule(tiny, full, monkeypatch):
    """linear 10 -> 2 over 8 steps: K = 2 + int((7 - s)/7 * 8) = 10, 8, 7, 6, 5, 4, 3, 2."""
    expected = [10, 8, 7, 6, 5, 4, 3, 2]
    strategy = strategies.create("disa", upper=10, lower=2)
    assert strategy.steps(tiny, NUM_ITER) == expected
    calls, net = [], tiny.diffloss.net
    forward = net.forward
    monkeypatch.setattr(net, "forward", lambda *a: calls.append(1) or forward(*a))
    plans = _Plans()
    res = mar_probe.sample(tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=5, strategy=strategy, observers=[plans])
    monkeypatch.undo()
    assert [p.head_steps for p in plans.plans] == expected
    assert [p.head["full"] for p in plans.plans] == expected             # no timestep above 950 at K <= 10
    assert len(calls) == sum(expected) < OWN * NUM_ITER                   # one network call per reverse step
    per_eval = [rec["flops"]["head.linear"] / OWN for rec in full.cost["steps"]]     # full: 10 evaluations a step
    assert per_eval[0] == head_eval_flops(net, 2 * 3 * 2)                 # step 0: 2 tokens x 3 images x 2 branches
    assert [rec["flops"]["head.linear"] for rec in res.cost["steps"]] == [k * f for k, f in zip(expected, per_eval)]
    assert _head_flops(res) < _head_flops(full)
    assert _transformer_flops(res) == _transformer_flops(full)            # the transformer runs in full


def test_default_options_follow_the_published_50_to_5(tiny):
    strategy = strategies.create("disa")
    assert strategy.to_dict() == {"name": "disa", "upper": 50, "lower": 5, "schedule": "linear", "clip_timestep": 950}
    assert strategy.steps(tiny, 64)[:3] == [50, 49, 48] and strategy.steps(tiny, 64)[-1] == 5
    plans = _Plans()
    res = mar_probe.sample(tiny, [0], num_iter=4, cfg=3.0, seed=0, strategy=strategy, observers=[plans])
    assert torch.isfinite(res.tokens).all()
    assert [p.head_steps for p in plans.plans] == [50, 35, 20, 5]
    # the clamp at 950 merges the kept timesteps above it: 50 steps keep 958, 979, 999 (-> 48), 35 keep 970, 999
    # (stride 999/34: -> 34), 20 only 999 (stride 999/19, the one below is 946: -> 20), 5 only 999
    assert [p.head["full"] for p in plans.plans] == [48, 34, 20, 5]


# ---- fidelity -----------------------------------------------------------------------------------------------
def _noise_free(model, strategy):
    """Tokens with the head's per-step noise off (temperature 0) and its initial noise from its own generator, so
    that runs differ only by their head steps (the generators stay in step whatever the number of reverse steps)."""
    rng = SampleRNG("seeded", np.random.default_rng(5), torch.Generator().manual_seed(5),
                    torch.Generator().manual_seed(6))
    sampler = Sampler(model, strategy)
    labels = torch.tensor(LABELS)
    with torch.no_grad():
        tokens, _ = sampler.run(labels, rng, num_iter=NUM_ITER, cfg=3.0, cfg_schedule="linear", temperature=0.0)
    return tokens


def test_fidelity_is_finite_and_degrades_gracefully(tiny, full):
    ref = _noise_free(tiny, strategies.create("full"))
    mse = {}
    for lower in (2, 5, 8):
        tokens = _noise_free(tiny, strategies.create("disa", upper=OWN, lower=lower, clip_timestep=None))
        assert torch.isfinite(tokens).all()
        mse[lower] = float(((tokens - ref) ** 2).mean())
    exact = _noise_free(tiny, strategies.create("disa", **DiSAStrategy.exact_options(NUM_ITER)))
    assert torch.equal(exact, ref)
    assert mse[2] > mse[5] > mse[8] > 0, mse                              # closer to full as the lower bound rises
    res = _disa(tiny, upper=OWN, lower=2)                                  # ordinary sampling: finite, not full's
    assert torch.isfinite(res.tokens).all() and float(((res.tokens - full.tokens) ** 2).mean()) > 0


# ---- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(lower=9, upper=3), r"disa lower=9 exceeds upper=3: .*expected 2 <= lower <= upper"),
    (dict(upper=0), r"disa upper must be an integer >= 2 \(a reverse process of one step .*\) or None, got 0"),
    (dict(lower=1), r"disa lower must be an integer >= 2 .* or None, got 1"),
    (dict(lower=-2), r"disa lower must be an integer >= 2 .* or None, got -2"),
    (dict(upper=True), r"disa upper must be an integer >= 2 .* or None, got True"),
    (dict(lower=2.5), r"disa lower must be an integer >= 2 .* or None, got 2.5"),
    (dict(clip_timestep=0), r"disa clip_timestep must be a positive integer or None, got 0"),
    (dict(schedule="exponential"), r"disa schedule must be one of \('linear', 'cosine', 'two-stage', 'constant'\), "
                                   r"got 'exponential'"),
])
def test_bad_options_are_refused_naming_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        strategies.create("disa", **options)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"no option\(s\) \['uper'\].*upper: int \| None = 50.*lower: int \| None = 5"):
        strategies.create("disa", uper=3)
    assert strategies.parse_options("disa", ["lower=2", "upper=none", "schedule=cosine", "clip_timestep=None"]) == \
        dict(lower=2, upper=None, schedule="cosine", clip_timestep=None)


def test_schedule_outside_the_heads_steps_is_refused(tiny):
    with pytest.raises(ValueError, match=r"disa head-step schedule 1200->5 is outside the head's steps: upper=1200, "
                                         r"but a respacing of its 1000-step diffusion takes 2 to 1000 steps"):
        _disa(tiny, upper=1200)
    with pytest.raises(ValueError, match=r"disa lower=20 \(20 steps\) exceeds upper=None \(10 steps; None is the "
                                         r"head's own 10\)"):
        _disa(tiny, upper=None, lower=20)
    for steps in (0, 1, 1001):
        with pytest.raises(ValueError, match=rf"head steps {steps} are outside the head's steps: .* 2 to 1000 steps"):
            tiny.diffloss.diffusion_for(steps)
    with pytest.raises(ValueError, match=r"disa step 8 is outside a run of 8 steps"):
        annealed_steps(8, 8, 10, 2)


# ---- command line ---------------------------------------------------------------------------------------------
def test_cli_generate_with_disa(tmp_path):
    out = tmp_path / "gen"
    rc = main(["generate", "--model", "mar_tiny", "--num-samples", "2", "--labels", "4,2", "--num-iter", "4",
               "--cfg", "2.0", "--threads", "1", "--strategy", "disa", "--strategy-opt", "lower=2",
               "--out", str(out)])
    assert rc == 0
    d = np.load(out / "samples.npz")
    assert d["tokens"].shape == (2, 64, 4) and np.isfinite(d["tokens"]).all()
    settings = json.loads((out / "settings.json").read_text())
    assert settings["strategy"]["name"] == "disa" and settings["strategy"]["lower"] == 2
