"""Analysis against plain numpy loops on a small synthetic run; categories; bad inputs; `mar-probe figures`."""
import numpy as np
import pandas as pd
import pytest
import xarray as xr

import mar_probe.analysis as A

S_BUF, GRID, STEPS, LAYERS, HEADS, DH, DM = 2, 3, 4, 3, 2, 4, 6
N = S_BUF + GRID * GRID
UNKNOWN_AFTER = (6, 3, 1, 0)   # image tokens still unknown after each step (cosine-like schedule)


def _masks(order):
    """mask (unknown before) and pred (generated at) per step from a generation rank, as the sampler does."""
    mask, pred = np.zeros((STEPS, N), bool), np.zeros((STEPS, N), bool)
    before = GRID * GRID
    for s, after in enumerate(UNKNOWN_AFTER):
        mask[s, S_BUF:] = order < before
        pred[s, S_BUF:] = (order < before) & (order >= after)
        before = after
    return mask, pred


def synthetic_run(seed=0, samples=3, chunked=True):
    """A dataset with the store's dims, coordinates and variable names; random activations."""
    rng = np.random.default_rng(seed)
    orders = np.stack([rng.permutation(GRID * GRID) for _ in range(samples)])
    mp = [_masks(o) for o in orders]
    tok = np.arange(N)
    img = tok - S_BUF
    coords = {"sample": np.arange(samples), "seed": ("sample", 100 + np.arange(samples)),
              "step": np.arange(STEPS), "branch": ["cond", "uncond"], "layer": np.arange(LAYERS),
              "token": tok, "row": ("token", np.where(img >= 0, img // GRID, -1)),
              "col": ("token", np.where(img >= 0, img % GRID, -1))}
    lead = ("sample", "step", "branch")
    kv_shape = (samples, STEPS, 2, LAYERS, N, HEADS, DH)
    z = rng.normal(size=(samples, STEPS, 2, N, DM)).astype(np.float32)
    z[:, :, :, :S_BUF] = np.nan
    data = {"dec_k": (lead + ("layer", "token", "head", "d_head"), rng.normal(size=kv_shape).astype(np.float16)),
            "dec_v": (lead + ("layer", "token", "head", "d_head"), rng.normal(size=kv_shape).astype(np.float16)),
            "dec_resid_post": (lead + ("layer", "token", "d_model"),
                               rng.normal(size=(samples, STEPS, 2, LAYERS, N, DM)).astype(np.float16)),
            "z": (lead + ("token", "d_model"), z),
            "z_cfg_resid": (("sample", "step", "token", "d_model"), z[:, :, 0] - z[:, :, 1]),
            "attn_gen": (lead + ("layer", "token"), rng.random((samples, STEPS, 2, LAYERS, N)).astype(np.float32)),
            "mask": (("sample", "step", "token"), np.stack([m for m, _ in mp])),
            "pred": (("sample", "step", "token"), np.stack([p for _, p in mp])),
            "order": (("sample", "token"), np.concatenate([-np.ones((samples, S_BUF), int), orders], 1))}
    ds = xr.Dataset(data, coords)
    return ds.chunk({"sample": 1, "step": 1}) if chunked else ds


@pytest.fixture(scope="module")
def run():
    return synthetic_run()


@pytest.fixture(scope="module")
def run_np():
    """The same run held in numpy arrays (no dask graph: fast for whole-run summaries)."""
    return synthetic_run(chunked=False)


def _np_cos(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return a @ b / np.sqrt((a @ a) * (b @ b))


def test_categories_match_definitions(run):
    codes = A.token_categories(run).values
    names = np.array(A.CATEGORIES)[codes]
    mask, pred = run["mask"].values, run["pred"].values
    for i in range(run.sizes["sample"]):
        for s in range(STEPS):
            for t in range(N):
                if t < S_BUF:
                    want = "buffer"
                elif pred[i, s, t]:
                    want = "t"
                elif mask[i, s, t]:
                    want = ">t"
                elif s > 0 and pred[i, s - 1, t]:
                    want = "t-1"
                else:
                    want = "<t-1"
                assert names[i, s, t] == want, (i, s, t)
    assert (names[:, 0, S_BUF:] != "<t-1").all() and (names == "t-1").any() and (names == "<t-1").any()


def test_categories_without_previous_step_are_unknown(run):
    names = np.array(A.CATEGORIES)[A.token_categories(run.sel(step=[0, 2])).values]
    known_before = ~run["mask"].sel(step=2).values & (run["token"].values >= S_BUF)
    assert (names[:, 1][known_before] == "unknown").all()


def test_cosine_stability_matches_numpy_loop(run):
    got = A.cosine_stability(run["dec_k"], lag=2).compute()
    assert got.dims == ("sample", "step", "branch", "layer", "token") and list(got["step"].values) == [2, 3]
    x = run["dec_k"].values
    for i, s, b, ly, t in [(0, 2, 0, 0, 3), (2, 3, 1, 2, 10), (1, 3, 0, 1, 0)]:
        assert got.sel(sample=i, step=s, layer=ly, token=t).isel(branch=b).item() == pytest.approx(
            _np_cos(x[i, s, b, ly, t], x[i, s - 2, b, ly, t]), rel=1e-5)
    per_head = A.cosine_stability(run["dec_k"], dim="d_head").values
    assert per_head[0, 0, 0, 1, 4, 1] == pytest.approx(_np_cos(x[0, 1, 0, 1, 4, 1], x[0, 0, 0, 1, 4, 1]), rel=1e-5)


def test_cosine_known_answers():
    ds = synthetic_run(chunked=False)
    k = ds["dec_k"].values.copy()
    k[:, 1] = 3 * k[:, 0]
    k[:, 2] = -k[:, 1]
    cos = A.cosine_stability(ds.assign(dec_k=(ds["dec_k"].dims, k))["dec_k"]).values
    np.testing.assert_allclose(cos[:, 0], 1, atol=1e-3)
    np.testing.assert_allclose(cos[:, 1], -1, atol=1e-3)
    l2 = A.drift(ds.assign(dec_k=(ds["dec_k"].dims, k))["dec_k"], metric="l2").values
    np.testing.assert_allclose(l2[:, 0], 2, rtol=1e-3)


def test_stability_summary_matches_loop(run):
    cos = A.cosine_stability(run["dec_v"])
    cats = A.token_categories(run)
    summ = A.summarize_stability(cos, cats, dim=("token", "branch"), thresholds=(0.0, 0.5)).compute()
    c, codes = cos.values, cats.values
    i, s, ly = 1, 2, 1
    for name in ("t", "t-1", ">t", "buffer"):
        sel = codes[i, s] == A.CATEGORIES.index(name)
        vals = c[i, s - 1, :, ly][:, sel].ravel()
        got = summ.sel(sample=i, step=s, layer=ly, category=name)
        assert got["mean"].item() == pytest.approx(vals.mean(), rel=1e-6)
        assert got["share"].sel(threshold=0.0).item() == pytest.approx((vals > 0).mean())
        assert got["count"].item() == vals.size


def test_cfg_residual_mse_matches_loop(run):
    out = A.cfg_residual_mse(run).compute()
    z = run["z"].values.astype(np.float64)
    for i, s in [(0, 1), (2, 3)]:
        d = z[i, s, :, S_BUF:] - z[i, s - 1, :, S_BUF:]
        cond, uncond = (d[0] ** 2).mean(), (d[1] ** 2).mean()
        resid = ((d[0] - d[1]) ** 2).mean()
        got = out.sel(sample=i, step=s)
        assert got["cond"].item() == pytest.approx(cond, rel=1e-5)
        assert got["uncond"].item() == pytest.approx(uncond, rel=1e-5)
        assert got["residual"].item() == pytest.approx(resid, rel=1e-5)
        assert got["ratio_cond"].item() == pytest.approx(cond / resid, rel=1e-5)


def test_cfg_residual_known_ratio():
    ds = synthetic_run(chunked=False)
    z = ds["z"].values.copy()
    z[:, :, 1] = z[:, :, 0] - 0.1 * z[:, :1, 0]         # residual 0.1 * z(step 0): constant across steps
    z[:, :, 1, :, :2] += 1e-3 * np.arange(STEPS)[None, :, None, None]  # tiny drift of the residual
    out = A.cfg_residual_mse(ds.assign(z=(ds["z"].dims, z)).drop_vars("z_cfg_resid")).compute()
    assert (out["ratio_cond"] > 1e3).all()


def _np_topk(score, eligible, k):
    s = np.where(eligible, score, -np.inf)
    return set(np.argsort(-s, kind="stable")[:min(k, eligible.sum())].tolist())


def test_topk_overlap_layers_and_steps_match_loop(run):
    got = A.topk_overlap_layers(run, k=[2, 4], ref_layer=1).values
    steps = A.topk_overlap_steps(run, k=3).values
    attn, pred = run["attn_gen"].sel(branch="cond").values, run["pred"].values
    for i in range(3):
        for s in range(STEPS):
            for ly in range(LAYERS):
                for j, k in enumerate((2, 4)):
                    a, r = _np_topk(attn[i, s, ly], ~pred[i, s], k), _np_topk(attn[i, s, 1], ~pred[i, s], k)
                    assert got[i, s, ly, j] == pytest.approx(len(a & r) / k)
                if s:
                    a = _np_topk(attn[i, s, ly], np.ones(N, bool), 3)
                    b = _np_topk(attn[i, s - 1, ly], np.ones(N, bool), 3)
                    assert steps[i, s - 1, ly] == pytest.approx(len(a & b) / 3)
    assert (got[:, :, 1] == 1).all()


def test_selection_vs_drift_matches_loop(run):
    actual = A.drift(run["dec_k"].sel(branch="cond", drop=True))
    sel = A.attention_selector(run, layer=0)
    cats = A.token_categories(run)
    out = A.selection_vs_drift(sel, actual, cats, k=[2, 3]).compute()
    thr = A.selection_vs_drift(sel, actual, cats, k=[2], threshold=0.9).compute()
    a, d, codes = sel.values, actual.values, cats.values
    cand = np.isin(codes, [A.CATEGORIES.index(c) for c in A.CANDIDATES])
    for i, s, ly in [(0, 1, 1), (2, 3, 2), (1, 2, 0)]:
        el = cand[i, s]
        for j, k in enumerate((2, 3)):
            top_a, top_d = _np_topk(a[i, s], el, k), _np_topk(d[i, s - 1, ly], el, k)
            got = out.isel(k=j).sel(sample=i, step=s, layer=ly)
            assert got["precision"].item() == pytest.approx(len(top_a & top_d) / len(top_a))
            assert got["jaccard"].item() == pytest.approx(len(top_a & top_d) / len(top_a | top_d))
            assert got["random_recall"].item() == pytest.approx(len(top_a) / el.sum())
        drifting = set(np.flatnonzero(el & (d[i, s - 1, ly] > 0.9)).tolist())
        top_a = _np_topk(a[i, s], el, 2)
        got = thr.isel(k=0).sel(sample=i, step=s, layer=ly)
        if drifting:
            assert got["recall"].item() == pytest.approx(len(top_a & drifting) / len(drifting))
        assert got["precision"].item() == pytest.approx(len(top_a & drifting) / 2)


def test_perfect_selector_has_full_precision(run):
    actual = A.drift(run["dec_k"].sel(branch="cond", drop=True)).sel(layer=2)
    out = A.selection_vs_drift(actual, actual, A.token_categories(run), k=[1, 2]).compute()
    assert (out["precision"] == 1).all() and (out["jaccard"] == 1).all()


def test_cfg_residual_from_cond_branch_and_stored_residual(run):
    both = A.cfg_residual_mse(run).compute()
    cond_only = A.cfg_residual_mse(run.sel(branch=["cond"])).compute()
    for q in ("cond", "uncond", "residual", "ratio_cond", "ratio_uncond"):
        np.testing.assert_allclose(cond_only[q].values, both[q].values, rtol=1e-5)


def test_lazymar_selector_matches_numpy_loop(run):
    score = A.lazymar_selector(run, layer=1).values
    v = run["dec_v"].sel(branch="cond").values
    actual = A.drift(run["dec_k"].sel(branch="cond", drop=True)).sel(layer=[2])
    out = A.selection_vs_drift(A.lazymar_selector(run, layer=1), actual, A.token_categories(run), k=[3]).compute()
    codes = A.token_categories(run).values
    cand = np.isin(codes, [A.CATEGORIES.index(c) for c in A.CANDIDATES])
    k = run["dec_k"].sel(branch="cond").values
    for i, s in [(0, 1), (1, 3), (2, 2)]:
        sc = np.array([1 - _np_cos(v[i, s, 1, t], v[i, s - 1, 1, t]) for t in range(N)])
        np.testing.assert_allclose(score[i, s - 1], sc, rtol=1e-4, atol=1e-6)
        dk = np.array([1 - _np_cos(k[i, s, 2, t], k[i, s - 1, 2, t]) for t in range(N)])
        top_v, top_k = _np_topk(sc, cand[i, s], 3), _np_topk(dk, cand[i, s], 3)
        got = out.sel(sample=i, step=s, layer=2).isel(k=0)
        assert got["precision"].item() == pytest.approx(len(top_v & top_k) / 3)


def test_topk_overlap_known_answers():
    ds = synthetic_run(chunked=False)
    attn = ds["attn_gen"].values.copy()
    attn[:, :, :, 0] = attn[:, :, :, 1]                    # layer 0 ranks like the reference: overlap 1
    attn[:, :, :, 2] = 2 - attn[:, :, :, 1]                # layer 2 ranks in reverse: disjoint top-K
    attn[:, 1:] = attn[:, :1]                              # every step like step 0
    out = A.topk_overlap_layers(ds.assign(attn_gen=(ds["attn_gen"].dims, attn)), k=[1, 2], ref_layer=1,
                                exclude_generating=False).values
    np.testing.assert_array_equal(out[:, :, 0], 1)
    np.testing.assert_array_equal(out[:, :, 2], 0)
    steps = A.topk_overlap_steps(ds.assign(attn_gen=(ds["attn_gen"].dims, attn)), k=4).values
    np.testing.assert_array_equal(steps, 1)


def test_run_summary_matches_numpy(run_np):
    from scipy import stats
    run = run_np
    table, skipped = A.run_summary(run, layer=1, k=3, threshold=0.1)
    assert skipped == {}
    k = run["dec_k"].sel(branch="cond").values.astype(np.float64)
    codes = A.token_categories(run).values
    row = table[(table["quantity"] == "share_cos>0.1") & (table["var"] == "dec_k") & (table["layer"] == 2)
                & (table["category"] == ">t")].iloc[0]
    per = []
    for i in range(3):
        cos = np.stack([[_np_cos(k[i, s, 2, t], k[i, s - 1, 2, t]) for t in range(N)] for s in range(1, STEPS)])
        vals = np.concatenate([cos[s - 1][codes[i, s] == A.CATEGORIES.index(">t")] for s in range(1, STEPS)])
        per.append((vals > 0.1).mean())
    half = stats.t.ppf(0.975, 2) * np.std(per, ddof=1) / np.sqrt(3)
    assert row["mean"] == pytest.approx(np.mean(per)) and row["n"] == 3
    assert row["lo"] == pytest.approx(max(0, np.mean(per) - half))      # shares: interval clipped to [0, 1]
    assert row["hi"] == pytest.approx(min(1, np.mean(per) + half))
    z = run["z"].values.astype(np.float64)[:, :, :, S_BUF:]
    ratios = [np.mean([((z[i, s, 0] - z[i, s - 1, 0]) ** 2).mean() for s in range(1, STEPS)])
              / np.mean([(((z[i, s, 0] - z[i, s, 1]) - (z[i, s - 1, 0] - z[i, s - 1, 1])) ** 2).mean()
                         for s in range(1, STEPS)]) for i in range(3)]
    got = table[table["quantity"] == "ratio_cond/residual"].iloc[0]
    assert got["mean"] == pytest.approx(np.mean(ratios), rel=1e-5)
    medians = [np.median([((z[i, s, 0] - z[i, s - 1, 0]) ** 2).mean()
                          / (((z[i, s, 0] - z[i, s, 1]) - (z[i, s - 1, 0] - z[i, s - 1, 1])) ** 2).mean()
                          for s in range(1, STEPS)]) for i in range(3)]
    got = table[table["quantity"] == "median_step_ratio_cond/residual"].iloc[0]
    assert got["mean"] == pytest.approx(np.mean(medians), rel=1e-5)
    sel = table[(table["section"] == "selection") & (table["quantity"] == "precision_topk_drift")]
    assert set(sel["selector"]) == {"attention@layer1", "lazymar_vcos@layer1", "random"}
    assert set(sel["layer"]) == {2} and (sel["n"] == 3).all()
    text = A.format_summary(table, skipped)
    assert "ratio_cond/residual" in text and "[stability] share_cos>0.1 of dec_k" in text


def test_run_summary_reports_what_the_store_lacks(run_np):
    run = run_np
    table, skipped = A.run_summary(run.drop_vars(["attn_gen", "dec_resid_post"]), k=2)
    assert "mar-probe record --vars attn_gen" in skipped["selection"]
    assert "mar-probe record --vars attn_gen" in skipped["overlap"]
    assert set(table["section"]) == {"stability", "cfg"}
    # issue 19: nonsense is refused before any compute instead of being 'skipped' with exit 0
    with pytest.raises(ValueError, match=r"layer 7 is not a decoder layer of this run; it recorded layers \[0, 1, 2\]"):
        A.run_summary(run, layer=7, k=2)
    with pytest.raises(ValueError, match="lazymar_layer -1 is not a decoder layer"):
        A.run_summary(run, layer=0, lazymar_layer=-1, k=2)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=f"k must be a positive integer \\(a refresh budget\\), got {bad!r}"):
            A.run_summary(run, k=bad)
    with pytest.raises(ValueError, match=r"threshold must lie in \(0, 1\)"):
        A.run_summary(run, k=2, threshold=1.5)
    none_done = run.assign(done=(("sample", "step"), np.zeros((run.sizes["sample"], run.sizes["step"]), bool)))
    with pytest.raises(ValueError, match="the run has no completed step"):
        A.run_summary(none_done, k=2)


def test_combine_runs_pools_samples_and_checks_steps():
    a, b = synthetic_run(seed=0, samples=2), synthetic_run(seed=1, samples=3)
    a.attrs["seed"], b.attrs["seed"] = 0, 1
    both = A.combine_runs([a, b], names=["a", "b"])
    assert both.sizes["sample"] == 5 and both["run_seed"].values.tolist() == [0, 0, 1, 1, 1]
    np.testing.assert_array_equal(both["dec_k"].isel(sample=3).values, b["dec_k"].isel(sample=1).values)
    assert A.aggregate(A.cfg_residual_mse(both)["cond"])["n"].min() == 5
    with pytest.raises(ValueError, match=r"run 1 has step \[0, 1\], run 0 has \[0, 1, 2, 3\]; expected the same steps"):
        A.combine_runs([a, b.sel(step=[0, 1])])


def test_stream_chunks_groups_steps_and_keeps_values(run):
    grouped = A.stream_chunks(run, max_bytes=3 * run["dec_k"].isel(sample=0, step=0).nbytes)
    assert grouped["dec_k"].chunks[1] == (3, 1) and grouped["dec_k"].chunks[0] == (1, 1, 1)
    np.testing.assert_array_equal(A.cosine_stability(grouped["dec_v"]).values,
                                  A.cosine_stability(run["dec_v"]).values)


def test_aggregate_t_and_bootstrap():
    x = xr.DataArray(np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, np.nan]]).T, dims=("sample", "step"))
    t = A.aggregate(x)
    from scipy import stats
    half = stats.t.ppf(0.975, 3) * np.std([1, 2, 3, 4], ddof=1) / 2
    assert t["mean"].values[0] == 2.5 and t["hi"].values[0] == pytest.approx(2.5 + half)
    assert t["n"].values.tolist() == [4, 3] and t["lo"].values[1] == pytest.approx(5)
    clipped = A.aggregate(x, bounds=(2.0, 3.0))
    assert clipped["lo"].values[0] == 2.0 and clipped["hi"].values[0] == 3.0 and clipped["mean"].values[0] == 2.5
    b = A.aggregate(x, method="bootstrap", n_boot=200)
    assert 1 <= b["lo"].values[0] <= 2.5 <= b["hi"].values[0] <= 4


def test_accessor_forwards(run):
    np.testing.assert_array_equal(run.probe.categories().values, A.token_categories(run).values)
    assert run.probe.selection_vs_drift(layer=0, k=2)["precision"].sizes["layer"] == LAYERS - 1
    assert float(run.probe.cfg_mse()["cond"].mean()) > 0


def test_bad_inputs_name_flags_and_list_what_is_there(run):
    with pytest.raises(KeyError, match=r"mar-probe record --vars attn_gen"):
        A.topk_overlap_layers(run.drop_vars("attn_gen"))
    with pytest.raises(ValueError, match=r"layer \[7\] not in the store; it has layer \[0, 1, 2\]"):
        A.attention_selector(run, layer=7)
    with pytest.raises(ValueError, match=r"steps \[0, 1, 2, 3\]"):
        A.cosine_stability(run["dec_k"], lag=9)
    with pytest.raises(ValueError, match=r"branch \['cond'\].*mar-probe record --vars z,z_cfg_resid"):
        A.cfg_residual_mse(run.sel(branch=["cond"]).drop_vars("z_cfg_resid"))
    with pytest.raises(ValueError, match="'nope'"):
        A.category_masks(A.token_categories(run), ["nope"])


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A real recorded store: mar_tiny (3+3 blocks), 2 samples x 6 steps, without dec_v (so marche_fig11 is skipped)."""
    from conftest import perturbed_tiny
    from mar_probe.probe.record import record
    from mar_probe.store.spec import SelectionSpec
    path = tmp_path_factory.mktemp("tiny") / "run.zarr"
    spec = SelectionSpec(variables=("dec_k", "dec_resid_post", "z", "z_cfg_resid", "attn_gen"))
    record(perturbed_tiny(encoder_depth=3, decoder_depth=3), np.arange(2), path, spec, seed=0, num_iter=6, cfg=2.0)
    return path


def test_figures_command_writes_png_csv_and_reports_skips(tiny_store, tmp_path, capsys):
    import pandas as pd
    from mar_probe.cli import main
    out = tmp_path / "figs"
    assert main(["figures", str(tiny_store), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped marche_fig11" in printed and "mar-probe record --vars dec_v" in printed
    for name in ("lazymar_fig1", "lazymar_fig2", "marche_fig1", "marche_fig10", "marche_fig12",
                 "selection_vs_drift"):
        assert (out / f"{name}.png").stat().st_size > 1000
        assert len(pd.read_csv(out / f"{name}.csv")) > 0
    assert not (out / "marche_fig11.png").exists()
    assert "marche_fig11 (skipped)" in (out / "index.md").read_text()
    html = (out / "index.html").read_text()
    assert "<img src='selection_vs_drift.png'" in html and "MARché Fig. 12" in html
    fig2 = pd.read_csv(out / "lazymar_fig2.csv")
    assert set(fig2["quantity"]) == {"cond", "uncond", "residual", "ratio_cond", "ratio_cond_overall",
                                     "ratio_cond_median_step"}
    assert (fig2["n"] == 2).all()


def test_figures_only_and_formats(tiny_store, tmp_path, capsys):
    from mar_probe.cli import main
    out = tmp_path / "some"
    assert main(["figures", str(tiny_store), str(tiny_store), "--out", str(out), "--only",
                 "lazymar_fig2,marche_fig12", "--format", "png,pdf"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["index.html", "index.md", "lazymar_fig2.csv", "lazymar_fig2.pdf", "lazymar_fig2.png",
                     "marche_fig12.csv", "marche_fig12.pdf", "marche_fig12.png"]
    assert (out / "lazymar_fig2.pdf").read_bytes()[:4] == b"%PDF"
    assert main(["figures", str(tiny_store), "--out", str(out), "--only", "fig99"]) == 2
    assert "unknown figure(s) ['fig99']; expected some of ['lazymar_fig1'" in capsys.readouterr().err
    assert main(["figures", str(tiny_store), "--out", str(out), "--format", "png,bmpx"]) == 2
    assert "unknown image format(s) ['bmpx']" in capsys.readouterr().err


def _lines(ax):
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


@pytest.mark.parametrize("name, x", [("lazymar_fig1", "step"), ("lazymar_fig2", "step"), ("marche_fig12", "step"),
                                     ("selection_vs_drift", "k")])
def test_csv_holds_exactly_the_plotted_lines(run, name, x):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mar_probe.plot.report import FIGURES
    data = FIGURES[name].data(run)
    ax = FIGURES[name].plot(data)
    axes = [ax] + [a for a in ax.figure.axes if a is not ax and a.bbox.bounds == ax.bbox.bounds]
    lines = {k: v for a in axes for k, v in _lines(a).items() if k in set(data["series"])}
    plotted = data[data["series"].isin(lines)]
    assert set(lines) == set(data["series"].dropna()) - {"ratio_cond_overall", "ratio_cond_median_step"}
    for series, g in plotted.groupby("series"):
        g = g.sort_values(x)
        np.testing.assert_allclose(lines[series].get_xdata(), g[x])
        np.testing.assert_allclose(lines[series].get_ydata(), g["mean"])
        assert (g["lo"] <= g["mean"] + 1e-12).all() and (g["hi"] >= g["mean"] - 1e-12).all()
    bands = sum(len(a.collections) for a in axes)
    assert bands == len(lines)
    if name == "lazymar_fig2":
        for q in ("ratio_cond_overall", "ratio_cond_median_step"):
            o = data[data["series"] == q].iloc[0]
            assert f"{o['mean']:.1f}x [{o['lo']:.1f}, {o['hi']:.1f}]" in ax.get_title()
    plt.close(ax.figure)


def test_csv_holds_exactly_the_plotted_maps(run):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mar_probe.plot import figures as F
    data = F.cosine_map_data(run, "dec_v", pairs=[(0, 1), (2, 3)], layers=[0, 2], sample=1)
    axes = F.marche_fig11(data)
    for i, (s0, layer) in enumerate([(0, 0), (0, 2), (2, 0), (2, 2)]):
        ax = axes[i // 2][i % 2]
        g = data[(data["step_from"] == s0) & (data["layer"] == layer)]
        np.testing.assert_allclose(ax.images[0].get_array(), g.pivot(index="row", columns="col", values="cos").values)
        assert f"{g['share_mean'].iloc[0]:.0%} [{g['share_lo'].iloc[0]:.0%}, " in ax.get_title()
    v = run["dec_v"].sel(branch="cond").values
    tok = S_BUF + 4
    row = data[(data["step_from"] == 2) & (data["layer"] == 2) & (data["token"] == tok)].iloc[0]
    assert row["cos"] == pytest.approx(_np_cos(v[1, 3, 2, tok], v[1, 2, 2, tok]), rel=1e-5)
    assert (row["row"], row["col"]) == (4 // GRID, 4 % GRID)
    plt.close(axes[0][0].figure)


def test_analyze_command_table_json_and_bad_inputs(tiny_store, tmp_path, capsys):
    import json
    from mar_probe.cli import main
    assert main(["analyze", str(tiny_store), "--k", "8", "--json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "* t-1 drifts most (dec_resid_post" in text and "ratio_cond/residual" in text
    assert "selection K=8, precision = recall vs the top-8 drifting tokens at layer 2" in text
    assert "[selection] skipped" not in text
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["settings"]["samples"] == 2 and report["settings"]["k"] == 8
    assert {r["section"] for r in report["rows"]} == {"stability", "cfg", "selection", "overlap"}
    assert main(["analyze", str(tiny_store), "--k", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["headlines"] == report["headlines"]
    assert main(["analyze", str(tiny_store), "--layer", "5"]) == 2
    assert "layer 5 is not a decoder layer of this run; it recorded layers [0, 1, 2]" in capsys.readouterr().err
    assert main(["analyze", str(tiny_store), "--k", "0"]) == 2
    assert "k must be a positive integer" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "nope.zarr")]) == 2
    assert "not found" in capsys.readouterr().err


def test_open_run_analysis_matches_numpy(tiny_store):
    from mar_probe.store import open_run
    ds = open_run(tiny_store)
    cos = A.cosine_stability(ds["dec_k"]).sel(sample=1, step=3, layer=1, branch="cond").values
    k = ds["dec_k"].sel(sample=1, layer=1, branch="cond").values
    t = int(ds["token"].values[-1])
    assert cos[t] == pytest.approx(_np_cos(k[3, t], k[2, t]), rel=1e-4)
    with pytest.raises(ValueError, match=r"step \[8, 9\] not in the store; it has step \[0, 1, 2, 3, 4, 5\]"):
        from mar_probe.plot.figures import cosine_map_data
        cosine_map_data(ds, pairs=[(8, 9)], layers=[0])


@pytest.mark.parametrize("quantity, bounds", [("median_step_ratio_cond/residual", (0.0, np.inf)),
                                              ("ratio_cond/residual", (0.0, np.inf)), ("mse_cond", (0.0, np.inf)),
                                              ("share_above_0.95", (0.0, 1.0)), ("mean_cos", (-1.0, 1.0)),
                                              ("mean_cos_minus_t-1", None)])
def test_every_summary_quantity_is_clipped_to_its_range(quantity, bounds):
    from mar_probe.analysis.summary import _bounds
    assert _bounds(quantity) == bounds


def test_summary_json_says_what_it_measured(tmp_path):
    """A summary file records its command, the machine and the runs' model, weights and settings (issue 15)."""
    from mar_probe.analysis.summary import SOURCE_ATTRS, summary_json
    ds = xr.Dataset(attrs={"weights_sha256": "ab" * 32, "model_preset": "fashion_small", "runs": "['a', 'b']",
                           "unrelated": 1})
    from mar_probe.analysis.summary import COLUMNS
    table = pd.DataFrame(columns=list(COLUMNS))
    report = summary_json(table, ds=ds, command="mar-probe analyze a b --json s.json")
    src = report["source"]
    assert src["command"] == "mar-probe analyze a b --json s.json" and src["weights_sha256"] == "ab" * 32
    assert src["model_preset"] == "fashion_small" and "unrelated" not in src and "cores" in src["machine"]
    assert set(src) <= {"command", "machine", *SOURCE_ATTRS}


def test_empty_sets_and_categories_are_nan_without_numpy_warnings():
    """An empty denominator (no token drifts at a step; a category with no token at a step) gives NaN, not 0 and
    not numpy's 'invalid value encountered in divide' that analyze and study used to print."""
    import warnings
    from mar_probe.analysis.selection import set_overlap
    sel = xr.DataArray(np.array([[True, False, True], [False, False, False]]), dims=("step", "token"))
    truth = xr.DataArray(np.array([[True, False, False], [False, False, False]]), dims=("step", "token"))
    eligible = xr.DataArray(np.array([[True, True, True], [False, False, False]]), dims=("step", "token"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = set_overlap(sel.chunk(), truth.chunk(), eligible.chunk()).compute()  # dask: numpy's own errstate
    np.testing.assert_allclose(out["precision"], [0.5, np.nan])
    np.testing.assert_allclose(out["recall"], [1.0, np.nan])
    np.testing.assert_allclose(out["random_recall"], [2 / 3, np.nan])
    cos = xr.DataArray(np.array([[0.5, 1.0], [np.nan, np.nan]]), dims=("step", "token"), coords={"step": [1, 2]})
    cats = xr.DataArray(np.full((2, 2), 1, dtype=np.int8), dims=("step", "token"), coords={"step": [1, 2]})
    with warnings.catch_warnings():                        # code 1 is "t-1"; step 2 has no valid token
        warnings.simplefilter("error", RuntimeWarning)
        summ = A.summarize_stability(cos.chunk(), cats.chunk(), names=[A.CATEGORIES[1]]).compute()
    np.testing.assert_allclose(summ["mean"].squeeze().values, [0.75, np.nan])
    np.testing.assert_allclose(summ["share"].sel(threshold=0.9).squeeze().values, [0.5, np.nan])
