"""Shared tests for every registered caching strategy, plus cache-aware attention and cost accounting."""
import pytest
import torch

import mar_probe
from mar_probe import strategies
from mar_probe.models.blocks import explicit_attention
from mar_probe.strategies.attention import cache_aware_attention
from mar_probe.strategies.layers import active_attention, block_mlp, full_block, gather_heads, gather_rows

NUM_ITER = 8
LABELS = [1, 7]


@pytest.fixture(scope="module")
def deep_tiny():
    """mar_tiny with enough layers for every cache (encoder 4, decoder 5, head 5) and non-trivial weights."""
    torch.manual_seed(0)
    model = mar_probe.create_model("mar_tiny", encoder_depth=4, decoder_depth=5, diffloss_d=5).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def full_result(deep_tiny):
    return mar_probe.sample(deep_tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=3)


def _run(model, strategy, **kw):
    kw = dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=3), **kw)
    return mar_probe.sample(model, LABELS, strategy=strategy, **kw)


# ---- cache-aware attention --------------------------------------------------------------------------------
def test_cache_aware_attention_equals_full_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g) * 3 for _ in range(3))
    perm = torch.randperm(12, generator=g)
    act, cached = perm[:5], perm[5:]
    ref = explicit_attention(q[:, :, act], k, v)
    out = cache_aware_attention(q[:, :, act], k[:, :, act], v[:, :, act], k[:, :, cached], v[:, :, cached], 8 ** -0.5)
    assert (out - ref).abs().max() < 1e-5
    alone = cache_aware_attention(q, k, v, None, None, 8 ** -0.5)
    assert (alone - explicit_attention(q, k, v)).abs().max() < 1e-5


def test_active_rows_with_fresh_cache_equal_full_block(deep_tiny):
    block = deep_tiny.decoder_blocks[2]
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(2))
    ref, k, v = full_block(block, x)
    assert torch.equal(ref, block(x))                                     # the runner is Block.forward
    act = torch.tensor([[0, 3, 4, 19], [1, 2, 10, 11]])
    rest = torch.stack([torch.tensor([i for i in range(20) if i not in row]) for row in act.tolist()])
    xm, _, _ = active_attention(block, gather_rows(x, act), gather_heads(k, rest), gather_heads(v, rest))
    assert (block_mlp(block, xm) - gather_rows(ref, act)).abs().max() < 1e-5


# ---- every strategy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", strategies.available())
def test_strategy_runs_and_is_deterministic(deep_tiny, name):
    a, b = _run(deep_tiny, name), _run(deep_tiny, strategies.create(name))
    assert a.tokens.shape == (2, 4, 8, 8) and torch.isfinite(a.tokens).all()
    assert torch.equal(a.tokens, b.tokens)
    assert a.settings["strategy"]["name"] == name


@pytest.mark.parametrize("name", strategies.available())
def test_refresh_everything_equals_full_exactly(deep_tiny, full_result, name):
    factory = strategies._REGISTRY[name]
    res = _run(deep_tiny, strategies.create(name, **factory.exact_options(NUM_ITER)))
    assert torch.equal(res.tokens, full_result.tokens)
    assert res.cost["totals"]["flops"] == full_result.cost["totals"]["flops"]


@pytest.mark.parametrize("name", strategies.available())
def test_cost_is_reported_per_step_and_component(deep_tiny, name):
    res = _run(deep_tiny, name)
    steps = res.cost["steps"]
    assert len(steps) == strategies.create(name).num_steps(NUM_ITER)
    for rec in steps:
        assert {"encoder", "decoder", "head"} <= set(rec["seconds"])
        assert {"encoder.linear", "encoder.attention", "decoder.linear", "decoder.attention", "head.linear"} \
            <= set(rec["flops"])
        assert rec["flops_total"] == sum(rec["flops"].values()) > 0
    assert res.cost["totals"]["flops_total"] == sum(s["flops_total"] for s in steps)


def test_unknown_strategy_and_option_list_valid_ones():
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'.*'full'.*'marche'.*budget: int = 64"):
        strategies.create("nope")
    with pytest.raises(ValueError, match=r"no option\(s\) \['budjet'\].*budget: int = 64.*selection: str = 'attention'"):
        strategies.create("marche", budjet=3)
    with pytest.raises(ValueError, match="mar_probe.sample|unknown strategy"):
        mar_probe.sample(mar_probe.create_model("mar_tiny").eval(), [0], num_iter=2, strategy="nope")


@pytest.mark.parametrize("name, options, match", [
    ("marche", dict(refresh_period=0), "refresh_period must be a positive integer, got 0"),
    ("marche", dict(budget=0), "budget must be a positive integer"),
    ("marche", dict(selection="top"), "selection must be one of"),
    ("lazymar", dict(refresh_interval=0), "refresh_interval must be an integer >= 1, got 0"),
    ("lazymar", dict(retain_schedule=(1.5,)), "retain_schedule"),
    ("fewer-steps", dict(num_iter=0), "num_iter must be a positive integer, got 0"),
])
def test_out_of_range_options_raise(name, options, match):
    with pytest.raises(ValueError, match=match):
        strategies.create(name, **options)


def test_budget_larger_than_sequence_raises(deep_tiny):
    with pytest.raises(ValueError, match=r"budget 69 exceeds the sequence: expected at most 68 rows"):
        _run(deep_tiny, strategies.create("marche", budget=69))


def test_parse_options_types():
    assert strategies.parse_options("marche", ["budget=32", "selection=random", "stacks=decoder"]) == \
        dict(budget=32, selection="random", stacks=("decoder",))
    assert strategies.parse_options("lazymar", ["retain_schedule=0.5,0.25", "head_cache=false"]) == \
        dict(retain_schedule=(0.5, 0.25), head_cache=False)
    with pytest.raises(ValueError, match="option 'budget' expects int, got 'many'"):
        strategies.parse_options("marche", ["budget=many"])


# ---- strategy specifics --------------------------------------------------------------------------------------
class _Plans:
    def __init__(self):
        self.plans = []

    def step_end(self, state, sampled):
        self.plans.append((state.step, state.to_pred.clone(), state.extras["plan"]))


def test_fewer_steps_runs_fewer_steps(deep_tiny):
    res = _run(deep_tiny, strategies.create("fewer-steps", num_iter=4))
    assert len(res.cost["steps"]) == 4 and res.settings["strategy"]["num_iter"] == 4


def test_marche_whole_sequence_budget_matches_full(deep_tiny, full_result):
    res = _run(deep_tiny, strategies.create("marche", budget=68))      # every row active: cache-aware path only
    assert (res.tokens - full_result.tokens).abs().max() < 1e-4


@pytest.mark.parametrize("selection", ["attention", "low-attention", "random"])
def test_marche_active_set_holds_generating_and_caching_tokens(deep_tiny, selection):
    obs = _Plans()
    _run(deep_tiny, strategies.create("marche", budget=20, selection=selection), observers=[obs])
    prev = None
    for step, to_pred, plan in obs.plans:
        assert plan.refresh == (step % 3 == 0)
        if not plan.refresh:
            dec = plan.active["decoder"]                                   # [B', S+L]
            assert dec.sum(1).tolist() == [max(20, int(to_pred[0].sum() + prev[0].sum()))] * 4
            assert dec[:, 4:][to_pred.repeat(2, 1) | prev.repeat(2, 1)].all()
            assert plan.rows["decoder"] == [68, 68] + [int(dec[0].sum())] * 3
            assert plan.active["encoder"][:, 4:][prev.repeat(2, 1)].all()
        prev = to_pred


def test_lazymar_caches_follow_the_released_schedule(deep_tiny):
    obs = _Plans()
    res = _run(deep_tiny, strategies.create("lazymar", warmup_steps=2, refresh_interval=3), observers=[obs])
    full = [p.refresh for _, _, p in obs.plans]
    assert full == [True, True, True, False, False, True, False, False]
    for step, to_pred, plan in obs.plans:
        assert plan.head["full"] == 3 and plan.head["cached"] == 7      # i = 9, 7, 0 of 10 recompute
        if not plan.refresh:
            assert plan.computed == ("cond",) and plan.derived == ("uncond",)
            assert plan.active["decoder"][:, 4:][to_pred].all()
    assert res.cost["totals"]["flops_total"] < _run(deep_tiny, "full").cost["totals"]["flops_total"]


def test_cli_generate_with_strategy_writes_cost_json(tmp_path, capsys):
    import json

    from mar_probe import cli
    args = ["generate", "--model", "mar_tiny", "--num-samples", "1", "--num-iter", "3", "--num-sampling-steps", "2",
            "--strategy", "marche", "--strategy-opt", "budget=20", "--strategy-opt", "selection=random",
            "--out", str(tmp_path)]
    assert cli.main(args) == 0
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert cost["strategy"]["budget"] == 20 and cost["strategy"]["selection"] == "random"
    assert len(cost["steps"]) == 3 and cost["totals"]["flops_total"] > 0
    assert cli.main(args[:-2] + ["--strategy-opt", "budjet=3", "--out", str(tmp_path)]) == 2
    assert "valid options: budget: int = 64" in capsys.readouterr().err
