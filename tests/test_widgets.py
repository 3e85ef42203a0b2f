"""Widgets, headless: partial decoding from the store alone, cosine maps against numpy loops, and driving the
explorer's and the strategy comparison's controls changes the figure's data (mar_tiny, a few seconds)."""
import json

import numpy as np
import pytest
import torch

import mar_probe
from mar_probe.probe import SelectionSpec, record
from mar_probe.widgets import compare_strategies, explore, load_results
from mar_probe.widgets import frames as F

NUM_ITER = 6


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    torch.manual_seed(3)
    model = mar_probe.create_model("mar_tiny").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial weights: the zero-initialised head would output constants
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path = tmp_path_factory.mktemp("widgets") / "run.zarr"
    spec = SelectionSpec(variables="dec_k,enc_k,z", layers=(0, 1))
    record(model, [1, 7], path, spec, seed=2, num_iter=NUM_ITER, cfg=2.0)
    return model, mar_probe.open_run(path)


def _cos_loop(a, b):
    """Cosine per token of [T, ...] float arrays with a plain loop (NaN where either is missing)."""
    out = np.full(a.shape[0], np.nan)
    for t in range(a.shape[0]):
        x, y = a[t].astype(np.float64).ravel(), b[t].astype(np.float64).ravel()
        if np.isfinite(x).all() and np.isfinite(y).all():
            out[t] = x @ y / np.sqrt((x @ x) * (y @ y))
    return out


# ---- frames: what the widgets draw ------------------------------------------------------------------------
def test_partial_image_last_step_is_the_decoded_image(tiny_run):
    _, ds = tiny_run
    for sample in (0, 1):
        img = F.partial_image(ds, sample, NUM_ITER - 1)
        assert np.array_equal(img, ds["images"].sel(sample=sample).values)


def test_decode_pixel_tokens_matches_the_model(tiny_run):
    model, ds = tiny_run
    tokens = torch.randn(3, model.seq_len, model.token_embed_dim, generator=torch.Generator().manual_seed(0))
    ref = mar_probe.decode_images(model, model.unpatchify(tokens))
    assert np.array_equal(F.decode_pixel_tokens(tokens.numpy(), ds.attrs["model_config"]), ref)


def test_canvas_grows_step_by_step_with_masked_tokens_as_zeros(tiny_run):
    _, ds = tiny_run
    known_counts = []
    for step in range(NUM_ITER):
        known, gen = F.known_after(ds, 0, step)
        canvas = F.canvas_tokens(ds, 0, step)
        assert (canvas[~known] == 0).all() and np.isfinite(canvas).all()
        if step:
            prev, _ = F.known_after(ds, 0, step - 1)
            assert np.array_equal(known, prev | gen) and not (prev & gen).any()
        known_counts.append(int(known.sum()))
    assert known_counts == sorted(known_counts) and known_counts[-1] == int((ds["row"].values >= 0).sum())
    # a still-masked token (zeros) decodes to mid-grey; a known one to the final image's pixels
    img0 = F.partial_image(ds, 0, 0)
    known0, _ = F.known_after(ds, 0, 0)
    cover = F.upsample_token_mask(~known0, ds.attrs["model_config"], img0.shape[:2])
    assert cover.any() and (img0[cover] == 128).all()
    final = ds["images"].sel(sample=0).values
    assert np.array_equal(img0[~cover], final[~cover])


@pytest.mark.parametrize("var,layer,branch", [("dec_k", 1, "uncond"), ("enc_k", 0, "cond"), ("z", None, "cond")])
def test_cosine_map_matches_numpy_loop(tiny_run, var, layer, branch):
    _, ds = tiny_run
    s0, s1 = 1, 3
    sel = {"sample": 1, "branch": branch} | ({"layer": layer} if layer is not None else {})
    x = ds[var].sel(sel).values  # [step, token, ...]
    want = _cos_loop(x[s1], x[s0])[ds["row"].values >= 0].reshape(8, 8)
    got = F.cosine_map(ds, var, 1, (s0, s1), layer, branch)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=0, atol=2e-6)
    if var == "enc_k":  # the encoder skips masked tokens: NaN exactly where a token is unknown at s0
        known, _ = F.known_after(ds, 1, s0 - 1)
        assert np.array_equal(~np.isnan(got).ravel(), known)


def test_cosine_map_bad_inputs(tiny_run):
    _, ds = tiny_run
    with pytest.raises(KeyError, match="--vars dec_v"):
        F.cosine_map(ds, "dec_v", 0, (1, 2), 0, "cond")
    with pytest.raises(ValueError, match=r"layer \[3\] not in the store; it has layer \[0, 1\]"):
        F.cosine_map(ds, "dec_k", 0, (1, 2), 3, "cond")
    with pytest.raises(ValueError, match="s0 < s1"):
        F.cosine_map(ds, "dec_k", 0, (2, 2), 0, "cond")


# ---- the explorer -----------------------------------------------------------------------------------------
def _snapshot(ex):
    return (np.ma.getdata(ex.map_artist.get_array()).copy(), np.asarray(ex.image_artist.get_array()).copy(),
            np.asarray(ex.overlay_artist.get_array()).copy(), ex.image.value)


def test_explorer_controls_change_the_figure(tiny_run):
    _, ds = tiny_run
    ex = explore(ds, var="dec_k")
    assert ex.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert ex.state() == {"var": "dec_k", "layer": 1, "steps": (4, 5), "branch": "cond", "sample": 0}
    np.testing.assert_allclose(np.ma.filled(ex.map_artist.get_array(), np.nan),
                               F.cosine_map(ds, "dec_k", 0, (4, 5), 1, "cond"), atol=0)
    first = F.cosine_map(ds, "dec_k", 0, (4, 5), 1, "cond")
    decoded = F.image_token_grid(ds, ds["pred"].sel(sample=0, step=4).values) > 0      # t-1 at step 5
    floor = min(np.percentile(first[np.isfinite(first)], 1), np.nanmin(first[decoded]))
    assert ex.map_artist.get_clim()[1] == 1.0
    assert floor - 1e-3 <= ex.map_artist.get_clim()[0] <= floor                 # the 1st pct or the lowest t-1 token
    assert (first[decoded] >= ex.map_artist.get_clim()[0]).all()                  # no t-1 token saturates
    before = _snapshot(ex)
    ex.controls["steps"].value = (1, 2)
    after = _snapshot(ex)
    assert all(not np.array_equal(a, b) for a, b in zip(before[:3], after[:3])) and before[3] != after[3]
    assert np.array_equal(np.asarray(ex.image_artist.get_array()), F.partial_image(ds, 0, 2)[..., 0])
    for name, value in (("branch", "uncond"), ("layer", 0), ("sample", 1)):
        prev = _snapshot(ex)
        ex.controls[name].value = value
        assert not np.array_equal(prev[0], _snapshot(ex)[0]), name
    assert not np.array_equal(prev[1], _snapshot(ex)[1])  # the sample changed the canvas too
    png = ex.image.value
    ex.controls["floor"].value = -0.5
    assert ex.map_artist.get_clim() == (-0.5, 1.0) and ex.image.value != png


def test_explorer_variable_without_layers_or_branch(tiny_run):
    _, ds = tiny_run
    ex = explore(ds)
    ex.controls["var"].value = "z"
    assert ex.controls["layer"].disabled and ex.state()["layer"] is None
    np.testing.assert_allclose(np.ma.filled(ex.map_artist.get_array(), np.nan),
                               F.cosine_map(ds, "z", 0, ex.state()["steps"], None, "cond"), atol=0)
    ex.controls["var"].value = "enc_k"
    assert not ex.controls["layer"].disabled and ex.state()["layer"] in (0, 1)
    assert "mean cosine" in ex.status.value


def test_explorer_bad_inputs(tiny_run, tmp_path):
    _, ds = tiny_run
    with pytest.raises(ValueError, match=r"unknown variable 'dec_v'; expected one of \['dec_k', 'enc_k', 'z'\]"):
        explore(ds, var="dec_v")
    with pytest.raises(ValueError, match="no per-step vector variable"):
        explore(ds[["mask", "pred", "tokens", "images"]])
    with pytest.raises(TypeError, match="expected an xarray.Dataset"):
        explore(42)
    with pytest.raises(FileNotFoundError):
        explore(tmp_path / "missing.zarr")


# ---- the strategy comparison ------------------------------------------------------------------------------
def _results(rng):
    imgs = {n: rng.integers(0, 256, (3, 8, 8, 1), dtype=np.uint8) for n in ("full", "lazymar", "marche")}
    return {"full": {"images": imgs["full"], "speedup": {"time": 1.0, "flops": 1.0}, "psnr": 60.0, "token_mse": 0.0},
            "lazymar": {"images": imgs["lazymar"], "speedup": {"time": {"mean": 2.1, "lo": 1.9, "hi": 2.3},
                                                                "flops": 2.8},
                        "psnr": {"mean": 27.5, "lo": 26.0, "hi": 29.0}, "token_mse": 0.02},
            "marche": {"images": imgs["marche"], "speedup": {"time": 1.6, "flops": 2.2}, "psnr": 31.0,
                       "token_mse": 0.01}}


def test_load_results_forms_agree(tmp_path, rng):
    res = _results(rng)
    as_list = [dict(v, strategy={"name": k, "budget": 64}) for k, v in res.items()]
    files = []
    for k, v in res.items():
        np.savez(tmp_path / f"{k}.npz", images=v["images"])
        files.append({**{m: v[m] for m in v if m != "images"}, "strategy": k, "samples": f"{k}.npz"})
    (tmp_path / "results.json").write_text(json.dumps({"strategies": files}))
    forms = [load_results(res), load_results(as_list), load_results(tmp_path),
             load_results(tmp_path / "results.json")]
    for entries in forms:
        assert [e.name for e in entries] == ["full", "lazymar", "marche"]
        assert sorted(entries[1].metrics) == ["psnr", "speedup.flops", "speedup.time", "token_mse"]
        m = entries[1].metrics["speedup.time"]
        assert (m.mean, m.lo, m.hi) == (2.1, 1.9, 2.3)
        assert np.array_equal(entries[2].images, res["marche"]["images"])


def test_load_results_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="mar-probe compare"):
        load_results(tmp_path)
    with pytest.raises(ValueError, match="must be uint8"):
        load_results({"full": {"images": np.zeros((2, 4, 4)), "psnr": 1.0}})
    with pytest.raises(ValueError, match="no strategy entries"):
        load_results({})


def test_compare_controls_change_the_figure(rng):
    res = _results(rng)
    cmp = compare_strategies(res)
    assert cmp.state() == {"sample": 0, "speed": "speedup.time", "fidelity": "psnr"}
    arrays = [np.asarray(a.get_array()).copy() for a in cmp.image_artists]
    assert np.array_equal(arrays[1], res["lazymar"]["images"][0, ..., 0])
    np.testing.assert_array_equal(cmp.scatter.get_offsets(), [[1.0, 60.0], [2.1, 27.5], [1.6, 31.0]])
    png = cmp.image.value
    cmp.controls["sample"].value = 2
    for art, name in zip(cmp.image_artists, ("full", "lazymar", "marche")):
        assert np.array_equal(np.asarray(art.get_array()), res[name]["images"][2, ..., 0])
    assert cmp.image.value != png
    cmp.controls["fidelity"].value = "token_mse"
    cmp.controls["speed"].value = "speedup.flops"
    np.testing.assert_array_equal(cmp.scatter.get_offsets(), [[1.0, 0.0], [2.8, 0.02], [2.2, 0.01]])
    assert "token_mse" in cmp.table.value and "[1.9, 2.3]" not in cmp.table.value
    with pytest.raises(ValueError, match="unknown fidelity metric 'ssim'"):
        compare_strategies(res, fidelity="ssim")


def test_compare_strategies_reads_compare_output(tiny_run, tmp_path):
    """The results.json + samples/ written by mar_probe.compare (`mar-probe compare`) open as written."""
    from mar_probe.compare import CompareConfig, StrategyRun, compare, write_results
    model, _ = tiny_run
    runs = (StrategyRun(label="marche", name="marche", options=(("budget", 8),)),
            StrategyRun(label="steps", name="fewer-steps", options=(("num_iter", 2),)))
    result = compare(model, CompareConfig(runs=runs, num_samples=2, num_iter=4, cfg=2.0), progress=False)
    out = write_results(result, tmp_path / "cmp")
    cmp = compare_strategies(out)
    assert [e.name for e in cmp.entries] == ["full", "marche", "steps"]
    assert cmp.state()["speed"] == "speedup.time" and cmp.state()["fidelity"] == "fidelity.psnr"
    assert not any(m.startswith(("config", "per_seed")) for m in cmp.metric_names)
    for e in cmp.entries:
        assert np.array_equal(e.images, result.runs[e.name][0].images)
        want = result.results["strategies"][e.name]["speedup"]["flops"]["mean"]
        assert e.metrics["speedup.flops"].mean == pytest.approx(want, rel=1e-12)
    cmp.controls["speed"].value = "speedup.flops"
    np.testing.assert_allclose(cmp.scatter.get_offsets()[:, 0],
                               [result.results["strategies"][n]["speedup"]["flops"]["mean"]
                                for n in ("full", "marche", "steps")])
