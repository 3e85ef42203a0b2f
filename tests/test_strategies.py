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
def full_result(deep_tiny):
    return mar_probe.sample(deep_tiny, LABELS, num_iter=NUM_ITER, cfg=3.0, seed=3)


def _run(model, strategy, **kw):
    kw = dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=3), **kw)
    return mar_probe.sample(model, LABELS, strategy=strategy, **kw)


# ---- cache-aware attention --------------------------------------------------------------------------------
@pytest.fixture(params=["fused", "explicit"])
def attention_path(request, monkeypatch):
    """Run a test with the fused CPU kernel for the partial attentions and with the explicit form."""
    from mar_probe.strategies import attention
    if request.param == "explicit":
        monkeypatch.setattr(attention, "_FUSED_CPU", None)
    elif attention._FUSED_CPU is None:
        pytest.skip("this PyTorch has no fused CPU flash-attention kernel")
    return request.param


def test_cache_aware_attention_equals_full_attention(attention_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g) * 3 for _ in range(3))
    perm = torch.randperm(12, generator=g)
    act, cached = perm[:5], perm[5:]
    ref = explicit_attention(q[:, :, act], k, v)
    out = cache_aware_attention(q[:, :, act], k[:, :, act], v[:, :, act], k[:, :, cached], v[:, :, cached], 8 ** -0.5)
    assert (out - ref).abs().max() < 1e-5
    alone = cache_aware_attention(q, k, v, None, None, 8 ** -0.5)
    assert (alone - explicit_attention(q, k, v)).abs().max() < 1e-5


def test_cache_aware_attention_is_safe_for_large_scores(attention_path):
    """Scores in the hundreds overflow a naive float32 exp; the log-sum-exp merge must stay finite and correct.

    Scores of size s carry a float32 rounding error of about s * 6e-8 before any softmax, so the comparison with a
    float64 reference allows 1e-4 here (the 1e-5 exactness is tested above on ordinary scores)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    q, k = q * 30, k * 30                                                 # |scores| up to ~1e3
    act, cached = torch.arange(0, 16, 2), torch.arange(1, 16, 2)
    assert not torch.isfinite(torch.exp(q @ k.transpose(-2, -1) * 8 ** -0.5)).all()   # naive exp overflows
    ref = explicit_attention(q[:, :, act].double(), k.double(), v.double())
    out = cache_aware_attention(q[:, :, act], k[:, :, act], v[:, :, act], k[:, :, cached], v[:, :, cached], 8 ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-4


def test_active_rows_with_fresh_cache_equal_full_block(deep_tiny, attention_path):
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
    with pytest.raises(ValueError,
                       match=r"no option\(s\) \['budjet'\].*budget: int = 64.*selection: str = 'attention'"):
        strategies.create("marche", budjet=3)
    with pytest.raises(ValueError, match="mar_probe.sample|unknown strategy"):
        mar_probe.sample(mar_probe.create_model("mar_tiny").eval(), [0], num_iter=2, strategy="nope")


def test_listed_defaults_are_values_also_where_a_factory_makes_them():
    assert strategies.options("compose")["token_opts"] == ("dict | str", {})
    listing = "; ".join(strategies.describe(n) for n in strategies.available())
    assert "token_opts: dict | str = {}" in listing and "MISSING" not in listing


@pytest.mark.parametrize("name, options, match", [
    ("marche", dict(refresh_period=0), "refresh_period must be a positive integer, got 0"),
    ("marche", dict(budget=0), "budget must be a positive integer"),
    ("marche", dict(selection="top"), "selection must be one of"),
    ("marche", dict(selection_layer=-1), "marche selection_layer must be an integer >= 0, got -1"),
    ("lazymar", dict(refresh_interval=0), "refresh_interval must be a positive integer, got 0"),
    ("lazymar", dict(retain_schedule=(1.5,)), "retain_schedule"),
    ("fewer-steps", dict(num_iter=0), "num_iter must be a positive integer, got 0"),
    ("lazymar", dict(warmup_steps=-1), "lazymar warmup_steps must be an integer >= 0, got -1"),
    ("compose", dict(head_interval=True), "compose head_interval must be a positive integer, got True"),
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
        self.plans.append((state.step, state.to_pred.clone(), state.outputs.plan))


def test_fewer_steps_runs_fewer_steps(deep_tiny):
    res = _run(deep_tiny, strategies.create("fewer-steps", num_iter=4))
    assert len(res.cost["steps"]) == 4 and res.settings["strategy"]["num_iter"] == 4


def test_fewer_steps_at_or_above_the_requested_count_is_full(deep_tiny, full_result):
    for n in (NUM_ITER, 3 * NUM_ITER):
        res = _run(deep_tiny, strategies.create("fewer-steps", num_iter=n))
        assert torch.equal(res.tokens, full_result.tokens) and len(res.cost["steps"]) == NUM_ITER
        assert res.cost["totals"]["flops"] == full_result.cost["totals"]["flops"]


def test_sample_takes_a_strategy_object_or_name_and_rejects_anything_else(deep_tiny, full_result):
    by_name, by_object = _run(deep_tiny, "full"), _run(deep_tiny, strategies.create("full"))
    assert torch.equal(by_name.tokens, full_result.tokens) and torch.equal(by_object.tokens, full_result.tokens)
    with pytest.raises(ValueError, match=r"strategy must be a Strategy object or one of the registered names "
                                         r"\[.*'full'.*'lazymar'.*\], got 3"):
        _run(deep_tiny, 3)


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


@pytest.mark.parametrize("selection_layer", [0, None, 3, 4])
def test_marche_selection_layer_is_0_based(deep_tiny, selection_layer):
    """Issue 18: ``selection_layer`` is a 0-based index like every layer index in mar_probe: layers
    0..selection_layer run on every row, the later ones (cached) on the active rows only; the default 1 is the
    paper's 1-based "layer 2" (two full layers, as before the change, when the default was 2)."""
    opts = {} if selection_layer is None else {"selection_layer": selection_layer}
    strategy = strategies.create("marche", budget=20, **opts)
    sel = strategy.config.selection_layer
    assert sel == (1 if selection_layer is None else selection_layer)
    obs = _Plans()
    res = _run(deep_tiny, strategy, observers=[obs])
    cached = [plan for _, _, plan in obs.plans if not plan.refresh]
    assert cached
    for plan in cached:
        dec = plan.rows["decoder"]                                         # deep_tiny: 5 decoder layers, 68 rows
        if sel + 1 >= len(dec):                                            # no later layer: the stack runs in full
            assert dec == [68] * 5 and "decoder" not in plan.active
            continue
        na = int(plan.active["decoder"][0].sum())
        assert na < 68 and dec == [68] * (sel + 1) + [na] * (4 - sel)
    if sel + 1 >= 5:                                                       # nothing cached in either stack
        assert res.cost["totals"]["flops"] == _run(deep_tiny, "full").cost["totals"]["flops"]


def test_lazymar_caches_follow_the_released_schedule(deep_tiny):
    obs = _Plans()
    res = _run(deep_tiny, strategies.create("lazymar", warmup_steps=2, refresh_interval=3), observers=[obs])
    full = [p.refresh for _, _, p in obs.plans]
    assert full == [True, True, True, False, False, True, False, False]
    for _step, to_pred, plan in obs.plans:
        assert plan.head["full"] == 3 and plan.head["cached"] == 7      # i = 9, 7, 0 of 10 recompute
        if not plan.refresh:
            assert plan.computed == ("cond",) and plan.derived == ("uncond",)
            assert plan.active["decoder"][:, 4:][to_pred].all()
    assert res.cost["totals"]["flops_total"] < _run(deep_tiny, "full").cost["totals"]["flops_total"]


def _released_head(net, T, interval=7, warm=0.9, delta_blocks=(1, 2, 3, 4)):
    """The released CachedDiffLoss arithmetic, written out plainly: every call runs both embeddings."""
    from mar_probe.models.diffloss import modulate
    cache = {}

    def forward(x, t, c, i, full):
        x = net.input_proj(x)
        y = net.time_embed(t) + net.cond_embed(c)
        for j, blk in enumerate(net.res_blocks):
            if not full and j in delta_blocks:
                x = x + cache["delta", j][:len(x)]
                continue
            shift, scale, gate = blk.adaLN_modulation(y).chunk(3, dim=-1)
            if full or i > warm * T:
                cache["mlp", j] = blk.mlp(modulate(blk.in_ln(x), shift, scale))
            new = x + gate * cache["mlp", j][:len(x)]
            if full:
                cache["delta", j] = new - x
            x = new
        return net.final_layer(x, y)

    def denoise(x, t, z, cfg, i):
        n, c = len(x) // 2, net.in_channels
        full = i == T - 1 or i % interval == 0
        if full:
            out = forward(torch.cat([x[:n], x[:n]]), t, z, i, True)
            cond, uncond = out[:n, :c], out[n:, :c]
            cache["cfg"], rest = cond - uncond, out[:, c:]
        else:
            out = forward(x[:n], t[:n], z[:n], i, False)
            cond, rest = out[:, :c], torch.cat([out[:, c:], out[:, c:]])
            uncond = cond - cache["cfg"]
        eps = uncond + cfg * (cond - uncond)
        return torch.cat([torch.cat([eps, eps]), rest], dim=1)
    return denoise


def test_lazymar_head_cache_follows_the_released_arithmetic(deep_tiny):
    """The head cache's embedding reuse (cond_embed once per recompute call, a timestep table) changes rounding
    only: one step's sampling equals the released arithmetic within float32 precision, and not the plain head."""
    diff = deep_tiny.diffloss
    diff.set_sampling_steps("30")
    try:
        z = torch.randn(6, 32, generator=torch.Generator().manual_seed(5))
        lazy = strategies.create("lazymar")

        def run(fn):
            return diff.sample(z, 1.0, 3.0, generator=torch.Generator().manual_seed(6), denoise_fn=fn)
        ours = run(_head_cache_denoise(lazy, diff))
        released, plain = run(_released_head(diff.net, 30)), run(None)
    finally:
        diff.set_sampling_steps(deep_tiny.config.num_sampling_steps)
    assert (ours - released).abs().max() < 1e-5
    assert (ours - plain).abs().max() > 1e-3                                  # the cache really changed the result


def test_lazymar_batched_head_modulation_changes_rounding_only(deep_tiny):
    """head_batch_modulation makes each kind of evaluation's AdaLN modulations in one product per step: the same
    values within float32 rounding, the same FLOPs less the embeddings it no longer needs (time_embed on the 7
    recompute evaluations, cond_embed on all but the step's first)."""
    diff = deep_tiny.diffloss
    diff.set_sampling_steps("30")
    try:
        z = torch.randn(6, 32, generator=torch.Generator().manual_seed(5))
        heads = {}
        for batched in (False, True):
            lazy = strategies.create("lazymar", head_batch_modulation=batched, head_interval=5)
            heads[batched] = _head_cache(lazy, diff)
            out = diff.sample(z, 1.0, 3.0, generator=torch.Generator().manual_seed(6),
                              denoise_fn=heads[batched].denoise)
            heads[batched].out = out
    finally:
        diff.set_sampling_steps(deep_tiny.config.num_sampling_steps)
    assert (heads[True].out - heads[False].out).abs().max() < 1e-5
    from mar_probe.engine.cost import head_embed_flops
    saved = 7 * head_embed_flops(diff.net, 6, cond=False) + 6 * head_embed_flops(diff.net, 6, time=False)
    assert heads[False].flops - heads[True].flops == saved > 0
    assert heads[True].full == heads[False].full == 7 and heads[True].cached == heads[False].cached == 23
    assert set(heads[True].tables[False]) == {0, "final"}                     # deep_tiny: blocks 1-4 are deltas
    assert set(heads[True].tables[True]) == {0, 1, 2, 3, 4, "final"} and not heads[False].tables[False]
    assert heads[True].tables[False][0].shape[:2] == (23, 3)                   # [cached indices, cond half]
    assert heads[True].tables[True][0].shape[:2] == (7, 6)                     # [recompute indices, both halves]


def _head_cache(lazy, diff):
    """One step's head cache of ``lazy`` (its HeadCache part), outside a sampling run."""
    from mar_probe.strategies.head_cache import _StepCache
    return _StepCache(lazy.head.config, diff.net, diff.gen_diffusion.num_timesteps,
                      lambda: lazy.head._time_table(diff, torch.device("cpu"), None))


def _head_cache_denoise(lazy, diff):
    return _head_cache(lazy, diff).denoise


def test_cli_generate_with_strategy_writes_cost_json(tmp_path, capsys):
    import json

    from mar_probe import cli
    args = ["generate", "--model", "mar_tiny", "--num-samples", "1", "--num-iter", "3", "--num-sampling-steps", "2",
            "--cfg", "3.0", "--strategy", "marche", "--strategy-opt", "budget=20", "--strategy-opt", "selection=random",
            "--out", str(tmp_path)]
    assert cli.main(args) == 0
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert cost["strategy"]["budget"] == 20 and cost["strategy"]["selection"] == "random"
    assert len(cost["steps"]) == 3 and cost["totals"]["flops_total"] > 0
    for rec in cost["steps"]:
        assert set(rec["seconds"]) == {"encoder", "decoder", "head"} and min(rec["seconds"].values()) > 0
        assert {k.split(".")[0] for k in rec["flops"]} == {"encoder", "decoder", "head"}
    assert cost["totals"]["flops_total"] == sum(rec["flops_total"] for rec in cost["steps"])
    assert abs(cost["totals"]["seconds_total"] - sum(rec["seconds_total"] for rec in cost["steps"])) < 1e-6
    assert cli.main(args[:-2] + ["--strategy-opt", "budjet=3", "--out", str(tmp_path)]) == 2
    assert "valid options: budget: int = 64" in capsys.readouterr().err
    bad_name = ["generate", "--model", "mar_tiny", "--num-samples", "1", "--strategy", "lazy-mar",
                "--out", str(tmp_path)]
    assert cli.main(bad_name) == 2
    err = capsys.readouterr().err
    assert "unknown strategy 'lazy-mar'" in err and "'lazymar'" in err and "refresh_interval: int = 9" in err


def test_kv_cache_and_row_helpers_equal_dense_indexing():
    """Position-major KVCache and the row helpers against plain per-row indexing, including b < B rows."""
    from mar_probe.strategies.layers import KVCache, scatter_rows
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 3, 10, 4, generator=g), torch.randn(2, 3, 10, 4, generator=g)
    cache = KVCache()
    cache.store(0, k, v, None, 10)
    pos = torch.tensor([[1, 4, 9], [0, 2, 3]])
    kc, vc = cache.fetch(0, pos)
    for b in range(2):
        assert torch.equal(kc[b], k[b][:, pos[b]]) and torch.equal(vc[b], v[b][:, pos[b]])
    new_k, new_v = torch.randn(1, 3, 3, 4, generator=g), torch.randn(1, 3, 3, 4, generator=g)
    cache.store(0, new_k, new_v, pos[:1], 10)                              # conditional row only
    assert torch.equal(cache.k[0][0][:, pos[0]], new_k[0]) and torch.equal(cache.v[0][1], v[1])
    assert torch.equal(cache.fetch(0, pos[1:])[0][0], k[0][:, pos[1]])                # the first row: b = 1
    x = torch.randn(2, 10, 5, generator=g)
    assert torch.equal(gather_rows(x, pos[1:])[0], x[0, pos[1]])
    y = x.clone()
    src = torch.randn(2, 3, 5, generator=g)
    scatter_rows(y, pos, src)
    for b in range(2):
        assert torch.equal(y[b, pos[b]], src[b])
        keep = [i for i in range(10) if i not in pos[b].tolist()]
        assert torch.equal(y[b, keep], x[b, keep])
    fresh = KVCache()
    fresh.store(3, new_k, new_v, pos[:1], 10)                              # sparse store into an empty cache
    assert fresh.k[3].shape == (1, 3, 10, 4) and torch.equal(fresh.fetch(3, pos[:1])[1], new_v)


def test_compose_condition_warmup_computes_both_branches_in_its_first_steps(deep_tiny):
    """condition_warmup=k: steps < k compute both CFG branches; covering every step it equals compose without the
    condition cache exactly, while the default derives the unconditional branch from step 1 on."""
    opts = dict(token_opts="budget=20", head_cache=False)
    never = _run(deep_tiny, strategies.create("compose", condition_cache=False, **opts))
    warm_all = _run(deep_tiny, strategies.create("compose", condition_warmup=NUM_ITER, **opts))
    assert torch.equal(warm_all.tokens, never.tokens)
    derived = _run(deep_tiny, strategies.create("compose", **opts))
    assert not torch.equal(derived.tokens, never.tokens)
    with pytest.raises(ValueError, match=r"condition_warmup must be an integer >= 0, got -1"):
        strategies.create("compose", condition_warmup=-1)


# ---- composable cache pieces (issue 18, item 4) -------------------------------------------------------------
def test_head_cache_is_a_part_any_strategy_can_hold(deep_tiny):
    """The head cache on the full baseline equals lazymar with only its head cache on, bit for bit, and compose
    holds the same part (no LazyMAR strategy borrowed for it)."""
    from mar_probe.engine import FullStrategy
    from mar_probe.strategies.head_cache import HeadCache, HeadCacheConfig

    class FullWithHeadCache(FullStrategy):
        name = "full+head-cache"

        def __init__(self):
            self.head = HeadCache(HeadCacheConfig(interval=3))

        def head_sample(self, model, z, state, rng):
            return self.head.head_sample(model, z, state, rng)

    lazy = strategies.create("lazymar", token_cache=False, condition_cache=False, refresh_interval=1, head_interval=3)
    mine = _run(deep_tiny, FullWithHeadCache())
    assert torch.equal(mine.tokens, _run(deep_tiny, lazy).tokens)
    assert not torch.equal(mine.tokens, _run(deep_tiny, "full").tokens)         # the cache does change the head
    compose = strategies.create("compose", head_interval=3)
    assert isinstance(compose.head, HeadCache) and compose.head.config == HeadCacheConfig(interval=3)


def test_compose_token_options_are_typed(deep_tiny):
    """token_opts is a typed dict; the command line's KEY=VALUE;... text parses into the same one."""
    text = strategies.create("compose", token_opts="budget=20;refresh_period=2", head_cache=False)
    typed = strategies.create("compose", token_opts={"budget": 20, "refresh_period": 2}, head_cache=False)
    assert text.config == typed.config and text.config.token_opts == {"budget": 20, "refresh_period": 2}
    assert torch.equal(_run(deep_tiny, text).tokens, _run(deep_tiny, typed).tokens)
    from mar_probe.strategies.compose import ComposeStrategy
    from mar_probe.strategies.marche import MARcheStrategy
    assert ComposeStrategy.exact_options(8)["token_opts"] == MARcheStrategy.exact_options(8)
    with pytest.raises(ValueError, match="strategy 'marche' has no option 'budjet'; valid options: budget: int"):
        strategies.create("compose", token_opts={"budjet": 3})
    with pytest.raises(ValueError, match="compose token_opts must be a dict of 'marche' options"):
        strategies.create("compose", token_opts=[("budget", 3)])
