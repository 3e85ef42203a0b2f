"""``recap`` (ReCAP, context-feature reuse): exactness, the released code's schedule, what cheap steps compute and
count, fidelity, options and the command line."""
import json

import numpy as np
import pytest
import torch

import mar_probe
from mar_probe import strategies
from mar_probe.cli import main
from mar_probe.engine.cost import head_eval_flops
from mar_probe.engine.loop import SampleRNG, Sampler
from mar_probe.models.blocks import explicit_attention
from mar_probe.probe import Probe, SelectionSpec
from mar_probe.strategies.layers import gather_heads, gather_rows, rows_of
from mar_probe.strategies.recap import ReCAPStrategy, recap_schedule
from mar_probe.strategies.reference import reference_trace

from conftest import perturbed_tiny

NUM_ITER = 8
LABELS = [1, 7]
OWN = 10                                             # mar_tiny's head steps (num_sampling_steps "10")


@pytest.fixture(scope="module")
def tiny():
    return perturbed_tiny()


def _run(model, strategy="full", observers=(), **kw):
    kw = dict(dict(num_iter=NUM_ITER, cfg=3.0, seed=3), **kw)
    return mar_probe.sample(model, LABELS, strategy=strategy, observers=list(observers), **kw)


def _recap(model, observers=(), num_iter=NUM_ITER, **opts):
    return _run(model, strategies.create("recap", **opts), observers, num_iter=num_iter)


class _Steps:
    """Observer keeping each step's plan and generated tokens."""

    def __init__(self):
        self.plans, self.to_pred = [], []

    def step_end(self, state, sampled):
        self.plans.append(state.outputs.plan)
        self.to_pred.append(state.to_pred.clone())


# ---- exactness ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "deep_tiny"])
@pytest.mark.parametrize("opts", [ReCAPStrategy.exact_options(NUM_ITER), dict(warmup_steps=NUM_ITER, cached_steps=3),
                                  dict(cached_steps=0, cache_buffer=True, head_fraction=0.2)])
def test_recomputing_everything_equals_full_bit_for_bit(request, model, opts):
    m = request.getfixturevalue(model)
    full = _run(m)
    res = _recap(m, **opts)
    assert torch.equal(res.tokens, full.tokens)
    assert res.cost["totals"]["flops"] == full.cost["totals"]["flops"]
    assert res.settings["strategy"]["name"] == "recap"


def test_defaults_are_the_published_commands(tiny):
    s = strategies.create("recap")
    assert s.to_dict() == {"name": "recap", "warmup_steps": None, "cached_steps": 1, "head_fraction": 0.4,
                           "cache_buffer": False}
    assert s.cheap_head_steps(tiny) == 4                                    # int(10 * 0.4)
    roles = s.schedule(64)                                                  # pre_full_iters = 64 // 2
    assert [i for i, r in enumerate(roles) if r] == list(range(33, 64, 2))
    assert roles.count(0) == 48
    assert strategies.create("recap").schedule(96).count(0) == 72           # MAR-L's 96-step command: 48 + 24


# ---- the schedule: golden values of the released code's loop -------------------------------------------------
@pytest.mark.parametrize("num_iter, warmup, cached, roles", [
    (8, 4, 1, [0, 0, 0, 0, 0, 1, 0, 1]),           # full below the warm-up, then full + 1 cheap
    (9, 4, 1, [0, 0, 0, 0, 0, 1, 0, 1, 0]),        # the last group is cut to its full pass (ratio 1 at once)
    (10, 3, 2, [0, 0, 0, 0, 1, 2, 0, 1, 2, 0]),    # two cheap steps a group
    (8, 0, 3, [0, 1, 2, 3, 0, 1, 2, 3]),           # no warm-up (the argparse default pre_full_iters=0)
    (7, 0, 3, [0, 1, 2, 3, 0, 1, 2]),              # the last group cut short
    (4, 4, 1, [0, 0, 0, 0]),                       # warm-up covers the run
    (4, 9, 1, [0, 0, 0, 0]),
    (5, 2, 0, [0, 0, 0, 0, 0]),                    # num_cache_iters = 0: plain MAR
    (1, 0, 1, [0]),
    (2, 0, 1, [0, 1]),
])
def test_schedule_golden_values(num_iter, warmup, cached, roles):
    assert recap_schedule(num_iter, warmup, cached) == roles


@pytest.mark.parametrize("num_iter, warmup, cached", [(8, 4, 1), (10, 3, 2)])
def test_runs_follow_the_schedule(tiny, num_iter, warmup, cached):
    """Full passes exactly at the schedule's full steps (two-sided), the cheap steps' head with int(10 * 0.4)."""
    roles = recap_schedule(num_iter, warmup, cached)
    obs = _Steps()
    _recap(tiny, [obs], num_iter=num_iter, warmup_steps=warmup, cached_steps=cached)
    assert [p.refresh for p in obs.plans] == [r == 0 for r in roles]
    assert [p.head_steps for p in obs.plans] == [None if r == 0 else 4 for r in roles]
    assert [p.head["full"] for p in obs.plans] == [OWN if r == 0 else 4 for r in roles]


# ---- what the cheap steps compute ----------------------------------------------------------------------------
@pytest.mark.parametrize("cache_buffer", [False, True])
def test_cheap_steps_compute_the_buffer_and_the_group(tiny, cache_buffer):
    """Decoder: buffer + every token of the group; encoder: buffer + the group's tokens generated since its full
    pass (10 steps, warm-up 3, groups of 1 full + 2 cheap: 3-5 and 6-8; step 9 is a lone full pass)."""
    obs = _Steps()
    _recap(tiny, [obs], num_iter=10, warmup_steps=3, cached_steps=2, cache_buffer=cache_buffer)
    s, b = tiny.buffer_size, len(LABELS)
    buf = torch.full((2 * b, s), not cache_buffer)
    for start in (3, 6):
        group = obs.to_pred[start] | obs.to_pred[start + 1] | obs.to_pred[start + 2]
        for step in (start + 1, start + 2):
            plan = obs.plans[step]
            since = obs.to_pred[start] if step == start + 1 else obs.to_pred[start] | obs.to_pred[start + 1]
            assert torch.equal(plan.active["decoder"], torch.cat([buf, group.repeat(2, 1)], 1)), step
            assert torch.equal(plan.active["encoder"], torch.cat([buf, since.repeat(2, 1)], 1)), step
            assert plan.rows["decoder"] == [int(plan.active["decoder"][0].sum())] * 2
            assert plan.computed == ("cond", "uncond")
    assert all(not p.active for i, p in enumerate(obs.plans) if i not in (4, 5, 7, 8))


class _Spy(ReCAPStrategy):
    """recap that keeps every step's state and decoder hidden state."""

    def __init__(self, **options):
        super().__init__(**options)
        self.seen = []

    def hidden(self, model, state, timer):
        out = super().hidden(model, state, timer)
        self.seen.append((state, out))
        return out


def _concat_stack(blocks, x, past):
    """Blocks on rows x whose queries attend to [past K/V; their own K/V] in one softmax, as the released code
    concatenates them (``Attention.forward``)."""
    for block, (kc, vc) in zip(blocks, past):
        q, k, v = block.attn.qkv_heads(block.norm1(x))
        o = explicit_attention(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2))
        x = x + block.attn.project(o)
        x = x + block.mlp(block.norm2(x))
    return x


@pytest.mark.parametrize("cache_buffer", [False, True])
def test_cheap_step_attends_to_the_full_pass_context(deep_tiny, cache_buffer):
    """A cheap step's rows equal the source's computation: the group's rows through both stacks, attending to
    the full pass's K/V of the context (recomputed here by the reference forward) concatenated with their own."""
    spy = _Spy(warmup_steps=4, cached_steps=1, cache_buffer=cache_buffer)
    _run(deep_tiny, spy)
    s, m = deep_tiny.buffer_size, deep_tiny
    for step in (5, 7):                                                     # groups 4-5 and 6-7
        (full, _), (cheap, out) = spy.seen[step - 1], spy.seen[step]
        ref = reference_trace(m, full)                                      # the full pass, bit-identical to full
        new = full.mask_in & ~cheap.mask_in                                 # generated at the full pass
        group = full.mask_in if step == NUM_ITER - 1 else full.mask_in & ~cheap.mask_next.repeat(2, 1)
        keep = slice(0, None) if cache_buffer else slice(s, None)           # context K/V: with or without buffer
        x = m.encoder_input(cheap.tokens_in, ~new, cheap.class_embedding)  # buffer + new rows
        x = x[:, s:] if cache_buffer else x
        x = m.encoder_norm(_concat_stack(m.encoder_blocks, x, [(k[:, :, keep], v[:, :, keep])
                                                               for k, v in zip(ref.encoder.k, ref.encoder.v)]))
        if cache_buffer:                                                    # placeholders: cached buffer rows unused
            x = torch.cat([x.new_zeros(x.shape[0], s, x.shape[2]), x], 1)
        x = m.decoder_input(x, ~new)                                        # [B', S+L, D]
        ctx = torch.cat([torch.full((2 * 2, s), cache_buffer), ~group], 1)  # [B', S+L] rows served from the cache
        rows = rows_of(~ctx)
        x = _concat_stack(m.decoder_blocks, gather_rows(x, rows),
                          [(gather_heads(k, rows_of(ctx)), gather_heads(v, rows_of(ctx)))
                           for k, v in zip(ref.decoder.k, ref.decoder.v)])
        assert (gather_rows(out, rows) - x).abs().max() < 1e-5, step
        assert torch.equal(gather_rows(out, rows_of(ctx)), gather_rows(spy.seen[step - 1][1], rows_of(ctx)))


def test_cheap_steps_count_fewer_flops_by_hand(tiny):
    """One image, 4 steps, warm-up 2: step 3 is cheap. mar_tiny: width 32, MLP 128, 2 + 2 layers, buffer 4, 64
    tokens, CFG: 2 branch rows. Mask lengths 59, 45, 24: 19 tokens known at the full pass (step 2), which
    generates 21; the group is the 45 tokens left. A block on n query rows against m keys: linear 2n(32*96 + 32*32 +
    32*128 + 128*32) = 24576n, attention 4 * n * m * 32 = 128nm."""
    one = dict(num_iter=4, cfg=3.0, seed=0)
    res = mar_probe.sample(tiny, [3], strategy=strategies.create("recap", warmup_steps=2), **one)
    full = mar_probe.sample(tiny, [3], **one)
    enc_n, enc_m = 4 + 21, 4 + 21 + 19                                      # buffer + new rows; + cached context
    dec_n, dec_m = 4 + 45, 68                                               # buffer + group; every position
    layers_rows = 2 * 2                                                     # 2 layers x 2 branch rows
    assert res.cost["steps"][3]["flops"] == {
        "encoder.linear": layers_rows * 24576 * enc_n + 2 * 2 * 64 * 4 * 32,        # + z_proj on the 64 tokens
        "encoder.attention": layers_rows * 128 * enc_n * enc_m,
        "decoder.linear": layers_rows * 24576 * dec_n + 2 * 2 * enc_n * 32 * 32,    # + decoder_embed on 25 rows
        "decoder.attention": layers_rows * 128 * dec_n * dec_m,
        "head.linear": 4 * head_eval_flops(tiny.diffloss.net, 2 * 24),             # 4 reverse steps, 24 tokens
    }
    assert res.cost["steps"][3]["flops"]["encoder.linear"] == 2490368
    assert res.cost["steps"][3]["flops"]["decoder.attention"] == 1705984
    for step in range(3):                                                   # full passes: full's FLOPs
        assert res.cost["steps"][step]["flops"] == full.cost["steps"][step]["flops"]
    for key, value in res.cost["steps"][3]["flops"].items():
        assert value < full.cost["steps"][3]["flops"][key], key


def test_cheap_steps_cost_less_than_full(deep_tiny):
    full = _run(deep_tiny)
    for opts in (dict(), dict(warmup_steps=0), dict(warmup_steps=0, head_fraction=1.0), dict(cache_buffer=True)):
        res = _recap(deep_tiny, **opts)
        assert res.cost["totals"]["flops_total"] < full.cost["totals"]["flops_total"], opts
        transformer = sum(v for k, v in res.cost["totals"]["flops"].items() if not k.startswith("head."))
        assert transformer < sum(v for k, v in full.cost["totals"]["flops"].items() if not k.startswith("head."))
    buffered = _recap(deep_tiny, cache_buffer=True).cost["totals"]["flops_total"]
    assert buffered < _recap(deep_tiny).cost["totals"]["flops_total"]          # buffer rows not recomputed


def test_probe_records_the_rows_cheap_steps_computed(deep_tiny):
    strategy = strategies.create("recap", warmup_steps=2)
    obs = _Steps()
    probe = Probe.for_run(deep_tiny, SelectionSpec(variables=("enc_k", "dec_k", "z"), dtype="float32"),
                          num_samples=2, num_iter=NUM_ITER, cfg=3.0)
    probe.begin_batch([0, 1])
    with probe.attached():
        res = _run(deep_tiny, strategy, [probe, obs])
    assert torch.equal(res.tokens, _recap(deep_tiny, warmup_steps=2).tokens)
    cheap = [i for i, p in enumerate(obs.plans) if not p.refresh]
    assert cheap == [3, 5, 7]
    for rec in probe.records:
        plan, a = obs.plans[rec.step], rec.arrays
        for st, stack in (("enc", "encoder"), ("dec", "decoder")):
            comp = a[f"{st}_computed"]                                      # [B, branches, layers, S+L]
            assert np.array_equal(np.isnan(a[f"{st}_k"][..., 0, 0]), ~comp)
            if not plan.refresh:
                want = plan.active[stack].reshape(2, 2, -1).transpose(0, 1).numpy()   # [B, branches, S+L]
                assert all(np.array_equal(comp[:, :, i], want) for i in range(comp.shape[2])), (rec.step, st)
        gen = obs.to_pred[rec.step].numpy()
        assert np.isfinite(a["z"][:, :, deep_tiny.buffer_size:][np.broadcast_to(gen[:, None], (2, 2, 64))]).all()


def test_compose_can_use_recap_as_its_token_policy(deep_tiny):
    exact = _run(deep_tiny, strategies.create("compose", tokens="recap", token_opts={"cached_steps": 0},
                                              head_cache=False))
    assert torch.equal(exact.tokens, _run(deep_tiny).tokens)
    res = _run(deep_tiny, strategies.create("compose", tokens="recap", token_opts="warmup_steps=2"))
    assert torch.isfinite(res.tokens).all()


# ---- fidelity -----------------------------------------------------------------------------------------------
def _noise_free(model, strategy, num_iter=16, seed=5):
    """Tokens with the head's per-step noise off (temperature 0), so that runs differ only by what is reused."""
    rng = SampleRNG("seeded", np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                    torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        tokens, _ = Sampler(model, strategy).run(torch.tensor([1, 7, 3]), rng, num_iter=num_iter, cfg=3.0,
                                                 cfg_schedule="linear", temperature=0.0)
    return tokens


def test_fidelity_is_finite_and_degrades_gracefully(tiny):
    ref = _noise_free(tiny, strategies.create("full"))
    assert torch.equal(_noise_free(tiny, strategies.create("recap", cached_steps=0)), ref)
    mse = {}
    for warmup in (14, 8, 0):                                               # 1, 4, 8 cheap steps of 16
        for fraction in (1.0, 0.4):
            tokens = _noise_free(tiny, strategies.create("recap", warmup_steps=warmup, head_fraction=fraction))
            assert torch.isfinite(tokens).all()
            mse[warmup, fraction] = float(((tokens - ref) ** 2).mean())
    assert 0 < mse[14, 1.0] < mse[8, 1.0] < mse[0, 1.0], mse                 # more reuse, further from full
    assert all(mse[w, 0.4] > mse[w, 1.0] for w in (14, 8, 0)), mse           # the shorter head adds its own error
    other_seed = float(((_noise_free(tiny, strategies.create("full"), seed=9) - ref) ** 2).mean())
    assert mse[0, 1.0] < other_seed / 4 and mse[0, 0.4] < other_seed, (mse, other_seed)   # closer than another seed


# ---- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(cached_steps=-1), r"recap cached_steps must be an integer >= 0, got -1"),
    (dict(cached_steps=True), r"recap cached_steps must be an integer >= 0, got True"),
    (dict(cached_steps=1.5), r"recap cached_steps must be an integer >= 0, got 1.5"),
    (dict(warmup_steps=-2), r"recap warmup_steps must be an integer >= 0 or None \(num_iter // 2\), got -2"),
    (dict(warmup_steps="4"), r"recap warmup_steps must be an integer >= 0 or None .*, got '4'"),
    (dict(head_fraction=0), r"recap head_fraction must be a number in \(0, 1\], got 0"),
    (dict(head_fraction=1.5), r"recap head_fraction must be a number in \(0, 1\], got 1.5"),
    (dict(head_fraction=True), r"recap head_fraction must be a number in \(0, 1\], got True"),
    (dict(head_fraction="0.4"), r"recap head_fraction must be a number in \(0, 1\], got '0.4'"),
    (dict(cache_buffer="yes"), r"recap cache_buffer must be True or False, got 'yes'"),
])
def test_bad_options_are_refused_naming_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        strategies.create("recap", **options)


def test_head_fraction_leaving_one_step_is_refused_before_sampling(tiny):
    with pytest.raises(ValueError, match=r"recap head_fraction 0.1 leaves int\(10 \* 0.1\) = 1 head steps at "
                                         r"cheap steps .* expected at least 2"):
        _recap(tiny, head_fraction=0.1)
    assert torch.isfinite(_recap(tiny, head_fraction=0.1, cached_steps=0).tokens).all()   # no cheap step: fine
    with pytest.raises(ValueError, match=r"recap schedule num_iter must be an integer >= 1, got 0"):
        recap_schedule(0, 0, 1)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"no option\(s\) \['cache_iters'\].*warmup_steps: int \| None = None, "
                                         r"cached_steps: int = 1, head_fraction: float = 0.4, cache_buffer: bool"):
        strategies.create("recap", cache_iters=1)
    assert strategies.parse_options("recap", ["warmup_steps=none", "cached_steps=2", "head_fraction=0.5",
                                              "cache_buffer=true"]) == \
        dict(warmup_steps=None, cached_steps=2, head_fraction=0.5, cache_buffer=True)


# ---- command line ---------------------------------------------------------------------------------------------
def test_cli_generate_with_recap(tmp_path, capsys):
    out = tmp_path / "gen"
    args = ["generate", "--model", "mar_tiny", "--num-samples", "2", "--labels", "4,2", "--num-iter", "6",
            "--cfg", "2.0", "--threads", "1", "--strategy", "recap", "--strategy-opt", "warmup_steps=2",
            "--strategy-opt", "head_fraction=0.5", "--out", str(out)]
    assert main(args) == 0
    d = np.load(out / "samples.npz")
    assert d["tokens"].shape == (2, 64, 4) and np.isfinite(d["tokens"]).all()
    settings = json.loads((out / "settings.json").read_text())
    assert settings["strategy"] == {"name": "recap", "warmup_steps": 2, "cached_steps": 1, "head_fraction": 0.5,
                                    "cache_buffer": False}
    cost = json.loads((out / "cost.json").read_text())
    flops = [rec["flops_total"] for rec in cost["steps"]]
    assert len(flops) == 6 and flops[3] < flops[2] and flops[5] < flops[4]   # steps 3 and 5 are cheap
    assert main(args[:-2] + ["--strategy-opt", "cache_iters=1", "--out", str(out)]) == 2
    assert "valid options: warmup_steps: int | None = None" in capsys.readouterr().err
