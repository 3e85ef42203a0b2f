"""Hook points, the Probe observer and the selection spec (tiny models, a few steps)."""
import json

import numpy as np
import pytest
import torch

import mar_probe
from mar_probe.hooks import list_hooks, resolve_hook, trace
from mar_probe import strategies
from mar_probe.probe import Probe, SelectionSpec
from mar_probe.store.spec import ACTIVATIONS
from mar_probe.store import estimate_size
from official_like import official_like

RUN = dict(num_iter=4, cfg=2.0, seed=3)


def _sample(model, observers=()):
    return mar_probe.sample(model, [1, 2], observers=observers, **RUN)


def _record(model, spec, labels=(1, 2)):
    probe = Probe.for_run(model, spec, num_samples=len(labels), num_iter=RUN["num_iter"], cfg=RUN["cfg"])
    probe.begin_batch(range(len(labels)))
    with probe.attached():
        res = mar_probe.sample(model, list(labels), observers=[probe], **RUN)
    return probe, res


def test_list_hooks_names_and_shapes(tiny_model):
    hooks = {h.name: h for h in list_hooks(tiny_model)}
    assert len(hooks) == 2 * 2 * 7 + 1
    assert hooks["enc.1.attn.hook_k"].module_path == "encoder_blocks.1.attn.hook_k"
    assert hooks["dec.1.hook_resid_post"].module_path == "decoder_blocks.1.hook_resid_post"
    assert hooks["z"].module_path == "hook_z"
    assert hooks["dec.0.attn.hook_q"].shape == "[B', H=2, N=68, Dh=16]"
    seen = {}
    with trace(tiny_model, ["dec.0.attn.hook_q", "z"], lambda n, t: seen.__setitem__(n, tuple(t.shape))):
        mar_probe.sample(tiny_model, [1], num_iter=2, cfg=2.0)
    assert seen == {"dec.0.attn.hook_q": (2, 2, 68, 16), "z": (2, 64, 32)}


def test_hooks_and_probe_leave_outputs_bitwise_identical(trained_like_tiny):
    m = trained_like_tiny
    plain = _sample(m)
    captured = []
    with trace(m, [h.name for h in list_hooks(m)], lambda n, t: captured.append(n)):
        hooked = _sample(m)
    _, probed = _record(m, SelectionSpec(variables=ACTIVATIONS, dtype="float32"))
    assert len(captured) == RUN["num_iter"] * (len(list_hooks(m)))
    for other in (hooked, probed):
        assert torch.equal(plain.tokens, other.tokens)
        assert np.array_equal(plain.images, other.images)


def test_official_like_model_hooks(trained_like_tiny):
    """A model with timm blocks (fused attn.qkv, no hook points): q/k/v/resid/z equal the native hooks."""
    m, twin = trained_like_tiny, official_like(trained_like_tiny)
    names = ["enc.1.attn.hook_q", "dec.0.attn.hook_k", "dec.1.attn.hook_v", "dec.1.hook_resid_post",
             "dec.0.attn.hook_attn_out", "dec.0.hook_mlp_out", "z"]
    assert resolve_hook(twin, "dec.0.attn.hook_k").module_path == "decoder_blocks.0.attn.qkv"
    got = {}
    for key, model in (("native", m), ("official", twin)):
        got[key] = {}
        with trace(model, names, lambda n, t, d=got[key]: d.setdefault(n, t.clone())):
            got[key]["out"] = _sample(model).tokens
    for n in names + ["out"]:
        assert torch.allclose(got["native"][n], got["official"][n], atol=1e-6), n
    assert torch.equal(_sample(twin).tokens, got["official"]["out"])
    with pytest.raises(ValueError, match="not available on this model"):
        resolve_hook(twin, "enc.0.hook_resid_mid")
    spec = SelectionSpec(variables=("enc_q", "dec_k", "dec_resid_post", "z", "attn_gen", "z_cfg_resid"),
                         dtype="float32")
    (native, _), (official, _) = _record(m, spec), _record(twin, spec)
    assert len(official.records) == RUN["num_iter"]
    for a, b in zip(native.records, official.records):
        for key, arr in a.arrays.items():
            assert np.allclose(arr, b.arrays[key], atol=1e-6, equal_nan=True), key   # NaN at the same places


@pytest.mark.parametrize("name, match", [("dec.9.attn.hook_k", "layer 9 out of range"),
                                         ("dec.0.attn.hook_x", "quantity in"), ("zz", "stack in")])
def test_unknown_hook_names_list_valid_ones(tiny_model, name, match):
    with pytest.raises(ValueError, match=match):
        resolve_hook(tiny_model, name)


def test_probe_arrays_layout_and_derived(trained_like_tiny):
    m = trained_like_tiny
    spec = SelectionSpec(variables=("enc_k", "dec_q", "dec_k", "z", "z_cfg_resid", "attn_gen"), dtype="float32",
                         layers=(1,))
    probe, _ = _record(m, spec)
    rec = probe.records[2]
    a, s = rec.arrays, m.buffer_size
    assert rec.step == 2 and rec.rows == (0, 1)
    assert a["enc_k"].shape == (2, 2, 1, s + m.seq_len, 2, 16)
    # encoder rows: buffer and known tokens are set, unknown tokens are NaN
    processed = ~np.isnan(a["enc_k"][:, 0, 0, :, 0, 0])
    assert np.array_equal(processed, ~a["mask"])
    assert np.isnan(a["z"][:, :, :s]).all() and not np.isnan(a["z"][:, :, s:]).any()
    assert np.allclose(a["z_cfg_resid"], a["z"][:, 0] - a["z"][:, 1], equal_nan=True, atol=1e-6)
    # attn_gen from the recorded q and k: mean over heads and generating rows of softmax(q k^T / sqrt(d))
    q, k = torch.from_numpy(a["dec_q"][:, :, 0]), torch.from_numpy(a["dec_k"][:, :, 0])  # [B, nb, N, H, Dh]
    att = torch.softmax(torch.einsum("bgnhd,bgmhd->bghnm", q, k) / 4.0, dim=-1)          # [B, nb, H, N, N]
    gen = torch.from_numpy(a["pred"])                                                    # [B, N]
    want = torch.stack([att[i][:, :, gen[i]].mean(dim=(1, 2)) for i in range(2)])        # [B, nb, N]
    assert np.allclose(a["attn_gen"][:, :, 0], want.numpy(), atol=1e-5)
    assert np.allclose(a["attn_gen"].sum(-1), 1.0, atol=1e-5)


def test_selection_spec_validation_and_roundtrip(tmp_path, tiny_model):
    spec = SelectionSpec(variables="dec_k,attn_gen", layers="0-1", steps=[3, 0], branches="cond", dtype="bfloat16")
    assert spec.variables == ("dec_k", "attn_gen") and spec.layers == (0, 1) and spec.steps == (0, 3)
    assert SelectionSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    (tmp_path / "s.yaml").write_text("variables: [dec_v, z]\nlayers: [1]\ndtype: float32\n")
    assert SelectionSpec.from_file(tmp_path / "s.yaml") == SelectionSpec(variables=("dec_v", "z"), layers=(1,),
                                                                         dtype="float32")
    with pytest.raises(ValueError, match=r"unknown variable\(s\) \['dec_x'\]; expected some of .*'dec_k'"):
        SelectionSpec(variables=("dec_x",))
    with pytest.raises(ValueError, match="dtype must be one of"):
        SelectionSpec(dtype="int8")
    with pytest.raises(ValueError, match="unknown SelectionSpec field"):
        SelectionSpec.from_dict({"layer": [1]})
    bad = [(dict(layers=(2,)), r"layer\(s\) \[2\] out of range"), (dict(steps=(4,)), r"step\(s\) \[4\]"),
           (dict(samples=(9,)), r"sample\(s\) \[9\]")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            estimate_size(SelectionSpec(**kw), tiny_model, 2, 4, cfg=2.0)
    with pytest.raises(ValueError, match="not in this run"):
        estimate_size(SelectionSpec(branches="uncond"), tiny_model, 2, 4, cfg=1.0)


def test_estimate_size(tiny_model):
    spec = SelectionSpec(variables=("dec_k", "z_cfg_resid"), layers=(0,))
    sizes = estimate_size(spec, tiny_model, num_samples=3, num_iter=4, cfg=2.0, images=(16, 16, 1))
    assert sizes["dec_k"] == 3 * 4 * 2 * 1 * 68 * 2 * 16 * 2
    assert sizes["z_cfg_resid"] == 3 * 4 * 68 * 32 * 2
    assert sizes["images"] == 3 * 16 * 16 and sizes["mask"] == 3 * 4 * 68
    bf = estimate_size(spec.replace(dtype="float32", branches="cond"), tiny_model, 3, 4, cfg=2.0)
    assert bf["dec_k"] == sizes["dec_k"]  # half the branches, twice the bytes


# ---- strategies that compute only some rows -----------------------------------------------------------------
NUM_ITER = 8
PARTIAL = {"lazymar": dict(warmup_steps=1, refresh_interval=4, retain_schedule=(0.3,)),
           "marche": dict(budget=20, refresh_period=4)}


class _Used:
    """Observer of what a strategy used at each step: the K in its caches, its plan, and the head's input z."""

    def __init__(self, strategy):
        self.strategy, self.steps, self.z = strategy, [], []
        head = strategy.head_sample

        def head_sample(model, z, state, rng):
            self.z.append(z.clone())                                    # [M', D] generating rows, branch-major
            return head(model, z, state, rng)
        strategy.head_sample = head_sample

    def step_end(self, state, sampled):
        s = self.strategy.token_policy()                                # lazymar's caches are its token part's
        caches = {"enc": s.caches["encoder"], "dec": s.caches["decoder"]} if hasattr(s, "caches") else \
            {"enc": s.enc_cache, "dec": s.dec_cache}
        self.steps.append({"plan": state.outputs.plan, "to_pred": state.to_pred.clone(),
                           "n_enc": state.enc_positions.shape[1],
                           "k": {st: {i: k.clone() for i, k in c.k.items()} for st, c in caches.items()}})


def _record_strategy(model, strategy, variables=ACTIVATIONS, observers=()):
    spec = SelectionSpec(variables=variables, dtype="float32")
    probe = Probe.for_run(model, spec, num_samples=2, num_iter=NUM_ITER, cfg=3.0)
    probe.begin_batch([0, 1])
    with probe.attached():
        res = mar_probe.sample(model, [1, 7], num_iter=NUM_ITER, cfg=3.0, seed=3, strategy=strategy,
                               observers=[probe, *observers])
    return probe.records, res


@pytest.fixture(scope="module")
def full_record(deep_tiny):
    return _record_strategy(deep_tiny, "full")


@pytest.mark.parametrize("name", [n for n in strategies.available() if n != "full"])
def test_strategy_refreshing_everything_records_exactly_the_full_record(deep_tiny, full_record, name):
    full, full_res = full_record
    exact = strategies.create(name, **strategies._REGISTRY[name].exact_options(NUM_ITER))
    got, res = _record_strategy(deep_tiny, exact)
    assert torch.equal(res.tokens, full_res.tokens) and len(got) == len(full) == NUM_ITER
    for a, b in zip(full, got):
        assert sorted(a.arrays) == sorted(b.arrays)
        for key, arr in a.arrays.items():
            assert np.array_equal(arr, b.arrays[key], equal_nan=True), (name, a.step, key)
    assert not any(r.arrays["derived"].any() for r in got)


def _check_stack(a, u, st, b=2):
    """Recorded K of stack ``st`` at one step: NaN exactly where not computed, the plan's active rows at cached
    layers, and at every computed row the K the strategy keeps in its cache. Returns the partial layers seen."""
    plan, stack = u["plan"], {"enc": "encoder", "dec": "decoder"}[st]
    comp, k = a[f"{st}_computed"], a[f"{st}_k"]                         # [B, nb, layers, N], [..., N, H, Dh]
    assert np.array_equal(np.isnan(k[..., 0, 0]), ~comp)
    n_full, act, partial = (u["n_enc"] if st == "enc" else comp.shape[-1]), plan.active.get(stack), 0
    for g, br in enumerate(("cond", "uncond")):
        if br not in plan.computed:
            assert not comp[:, g].any()
            continue
        for i in range(comp.shape[2]):
            if plan.rows[stack][i] < n_full:                               # a cached layer: the plan's rows
                assert np.array_equal(comp[:, g, i], act[g * b:(g + 1) * b].numpy())
                partial += 1
            else:
                assert comp[:, g, i].sum() == n_full * b
            cached = u["k"][st].get(i)
            if cached is not None and cached.shape[0] >= (g + 1) * b:
                want = cached[g * b:(g + 1) * b].transpose(1, 2).numpy()   # [B, N, H, Dh]
                assert np.array_equal(k[:, g, i][comp[:, g, i]], want[comp[:, g, i]])
    return partial


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_partial_row_strategy_records_what_it_computed(deep_tiny, name):
    strategy = strategies.create(name, **PARTIAL[name])
    used = _Used(strategy)
    recs, res = _record_strategy(deep_tiny, strategy, observers=[used])
    plain = mar_probe.sample(deep_tiny, [1, 7], num_iter=NUM_ITER, cfg=3.0, seed=3,
                             strategy=strategies.create(name, **PARTIAL[name]))
    assert torch.equal(res.tokens, plain.tokens)
    s, b, partial = deep_tiny.buffer_size, 2, 0
    for rec, u in zip(recs, used.steps):
        a = rec.arrays
        assert a["derived"].tolist() == [[br in u["plan"].derived for br in ("cond", "uncond")]] * b
        partial += _check_stack(a, u, "enc") + _check_stack(a, u, "dec")
        z, gen = a["z"], u["to_pred"].numpy()                             # [B, nb, N, D]; [B, L]
        head_z = used.z[rec.step].reshape(2, b, -1, z.shape[-1]).numpy()  # [nb, B, G, D]
        for g in range(2):
            for i in range(b):
                assert np.array_equal(z[i, g, s:][gen[i]], head_z[g, i])  # the head's input, derived branch too
        assert np.array_equal(np.isnan(z[:, 0, :, 0]) | np.isnan(z[:, 1, :, 0]), np.isnan(a["z_cfg_resid"][..., 0]))
    assert partial > 0
    if name == "lazymar":
        assert any(r.arrays["derived"][:, 1].all() for r in recs)
        p = strategy.config.prune_layer                                   # FFN only on kept rows there
        late = [r for r, u in zip(recs, used.steps) if not u["plan"].refresh][-1].arrays
        assert np.isnan(late["dec_resid_post"][:, 0, p, :, 0]).any() and late["dec_computed"][:, 0, p].all()
