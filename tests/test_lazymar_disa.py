"""``lazymar-disa`` (issue 17, item 2: the best composition named): the same runs as ``compose`` with the confirmed
composition's options, its flat options routed to the parts, its records, and its refusals. (Its exactness contract
and determinism are the registry-wide tests of tests/test_strategies.py.)"""
import pytest
import torch

import mar_probe
from mar_probe import strategies
from mar_probe.tune import TuneConfig

NUM_ITER = 8
# the arm as issue 17's confirmation ran it (benchmarks/results/frontier_b128_confirm/results.json)
CONFIRMED = {"tokens": "lazymar", "token_opts": "refresh_interval=16;warmup_steps=3", "head_schedule": "disa",
             "head_opts": "upper=25", "head_interval": 1, "head_batch_modulation": True}


def _run(model, strategy):
    return mar_probe.sample(model, [1, 7], strategy=strategy, num_iter=NUM_ITER, cfg=3.0, seed=3)


def _same(a, b):
    assert torch.equal(a.tokens, b.tokens)
    assert a.cost["totals"]["flops"] == b.cost["totals"]["flops"]


def test_defaults_are_the_confirmed_composition(deep_tiny):
    named, composed = strategies.create("lazymar-disa"), strategies.create("compose", **CONFIRMED)
    _same(_run(deep_tiny, named), _run(deep_tiny, composed))
    record = named.to_dict()
    assert record["name"] == "lazymar-disa" and record["refresh_interval"] == 16 and record["upper"] == 25
    shown = composed.to_dict()               # the confirmation gave DiSA's upper only; the record spells out all
    assert record["composition"] == dict({k: v for k, v in shown.items()
                                          if k not in ("name", "token_strategy", "head_schedule_config")},
                                         head_opts={"upper": 25, "lower": 5, "schedule": "linear",
                                                    "clip_timestep": 950})
    assert record["head_schedule_config"] == shown["head_schedule_config"]
    assert record["token_strategy"] == shown["token_strategy"]


def test_flat_options_reach_their_parts(deep_tiny):
    named = strategies.create("lazymar-disa", refresh_interval=3, warmup_steps=1, upper=12, lower=3,
                              schedule="cosine", head_interval=2, condition_cache=False)
    composed = strategies.create("compose", tokens="lazymar", token_opts={"refresh_interval": 3, "warmup_steps": 1},
                                 condition_cache=False, head_schedule="disa",
                                 head_opts={"upper": 12, "lower": 3, "schedule": "cosine"}, head_interval=2,
                                 head_batch_modulation=True)
    a, b = _run(deep_tiny, named), _run(deep_tiny, composed)
    _same(a, b)
    assert not torch.equal(a.tokens, _run(deep_tiny, "lazymar-disa").tokens)     # the options do change the run


@pytest.mark.parametrize("options, match", [
    ({"refresh_interval": 0}, r"lazymar-disa refresh_interval must be a positive integer, got 0"),
    ({"warmup_steps": -1}, r"lazymar-disa warmup_steps must be an integer >= 0, got -1"),
    ({"lower": 30}, r"disa lower=30 exceeds upper=25"),
    ({"schedule": "cos"}, r"disa schedule must be one of .*'linear'.*got 'cos'"),
    ({"token_opts": "budget=8"}, r"has no option\(s\) \['token_opts'\]; valid options: refresh_interval"),
])
def test_bad_options_are_refused_naming_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        strategies.create("lazymar-disa", **options)


def test_an_upper_bound_beyond_the_heads_diffusion_is_refused_before_sampling(deep_tiny):
    limit = deep_tiny.diffloss.train_diffusion.num_timesteps
    with pytest.raises(ValueError, match=rf"upper={limit + 1}, but a respacing of its {limit}-step diffusion"):
        _run(deep_tiny, strategies.create("lazymar-disa", upper=limit + 1))


def test_tune_searches_the_refresh_interval_and_bisects_the_upper_bound():
    config = TuneConfig(family="lazymar-disa", target="psnr>=30")
    assert [k for k, _ in config.space] == ["refresh_interval", "upper"]
    rows = config.rows()
    assert len(rows) == 4                                         # one per refresh interval, upper bisected
    assert all(strategies.create("lazymar-disa", **dict(run.options)) for row in rows for run in row)
