"""Numbers in prose come from files (issue 15): the pages rendered from templates and committed result files equal
the committed pages, intervals are clipped and flagged, and one table refuses result files that do not match."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import render_docs as R  # noqa: E402


@pytest.mark.parametrize("page", R.PAGES)
def test_committed_page_equals_its_rendering(page):
    committed = (R.ROOT / page).read_text()
    assert committed == R.render(page), (f"{page} differs from its template in benchmarks/templates/ rendered with "
                                         "the committed results: run `python benchmarks/render_docs.py`")


def test_check_names_a_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(R, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / R.PAGES[0]).write_text("typed by hand: 46.5 dB\n")
    assert R.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"stale generated page(s): {R.PAGES[0]}" in out and "-typed by hand: 46.5 dB" in out


@pytest.mark.parametrize("stat, metric, text", [
    ({"mean": 0.0032, "lo": -0.00156, "hi": 0.0079, "n": 210}, "token_mse", r"0.0032 [0, 0.0079]\*"),
    ({"mean": 0.95, "lo": 0.9, "hi": 1.17, "n": 20}, "class_accuracy", r"0.950 [0.900, 1.000]\*"),
    ({"mean": 0.5, "lo": 0.4, "hi": 0.6, "n": 20, "clipped": True}, "class_accuracy", r"0.500 [0.400, 0.600]\*"),
    ({"mean": 0.95, "lo": 0.9, "hi": 0.99, "n": 20}, "class_accuracy", "0.950 [0.900, 0.990]"),
    ({"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 3}, "class_accuracy", "1.000"),
    ({"mean": 2.0, "lo": None, "hi": None, "n": 1}, "speedup", "2.000"),
])
def test_intervals_are_clipped_to_the_range_and_flagged(stat, metric, text):
    assert R.interval_text(stat, ".3f" if metric != "token_mse" else ".2g", metric) == text


def _results(folder: Path, sha="a" * 64, temperature=0.6, psnr=30.0):
    folder.mkdir(parents=True)
    entry = {"label": "m", "steps": 16, "speedup": {"flops": {"mean": 2.0, "lo": 2.0, "hi": 2.0, "n": 1}},
             "fidelity": {"psnr": {"mean": psnr, "lo": psnr - 1, "hi": psnr + 1, "n": 8}}}
    settings = {"num_samples": 8, "labels": None, "seeds": [0], "num_iter": 16, "cfg": 3.0, "cfg_schedule": "linear",
                "temperature": temperature, "rng": "own"}
    (folder / "results.json").write_text(json.dumps({"format": "mar_probe.compare", "version": 1, "model": "x",
                                                     "weights_sha256": sha, "settings": settings,
                                                     "strategies": {"m": entry}}))


def test_one_table_refuses_results_of_another_model_or_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    _results(tmp_path / "a")
    _results(tmp_path / "b", psnr=31.0)
    _results(tmp_path / "c", sha="b" * 64, temperature=1.0)
    a, b, c = (R.CompareResults(n) for n in "abc")
    assert R.table([(a, "m", "A"), (b, "m", "B")], ["flops", "psnr"]).splitlines()[2:] == [
        "| A | 2.00 | 30.0 [29.0, 31.0] |", "| B | 2.00 | 31.0 [30.0, 32.0] |"]
    with pytest.raises(ValueError, match=r"result files 'a' and 'c' cannot share a table: they differ in "
                                         r"weights_sha256: 'a{64}' vs 'b{64}'; temperature: 0.6 vs 1.0"):
        R.table([(a, "m", "A"), (c, "m", "C")], ["psnr"])
    with pytest.raises(KeyError, match=r"'a' has no strategy 'lazymar'; it has \['m'\]"):
        a.mean("lazymar", "fidelity.psnr", ".1f")


@pytest.mark.parametrize("psnr, verdict", [(30.0, "above"), (-30.0, "below"), (0.5, "neither")])
def test_verdicts_follow_the_interval_and_need_one(tmp_path, monkeypatch, psnr, verdict):
    """A sentence's verdict (above / below / not told apart) is read off the interval, never off the mean alone:
    a mean of 0.5 with the interval [-0.5, 1.5] is not 'above'."""
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    _results(tmp_path / "a", psnr=psnr)
    res = R.CompareResults("a")
    assert res.versus("m", "fidelity.psnr", "above", "below", "neither") == verdict
    assert res.n("m") == 8
    res.data["strategies"]["m"]["fidelity"]["psnr"].update(lo=None, hi=None, n=1)
    with pytest.raises(ValueError, match=r"'a': 'm' 'fidelity.psnr' has no interval \(n = 1\); a verdict needs one"):
        res.versus("m", "fidelity.psnr", "above", "below", "neither")


def test_zoo_gives_its_fidelity_part_as_a_compare_result():
    """findings.md cites the zoo's fidelity part as a compare result named by zoo.json; the head's reuse is read
    from each arm's resolved config: lazymar's head cache (interval 7) reuses, full-b's (interval 1) and DiSA's
    annealed head (no cache) do not."""
    zoo = R.ZooResults()
    fid = zoo.fidelity
    assert fid.rel == "zoo.json" and fid.path == R.RESULTS / "zoo.json"
    assert fid.n("lazymar") == zoo.images == 210
    picked = zoo.arms["lazymar"]["fidelity"]["psnr"]  # the zoo's table keeps the interval of compare's statistic
    assert {k: fid.entry("lazymar")["fidelity"]["psnr"][k] for k in picked} == picked
    assert [zoo.reuses_head(a) for a in ("lazymar", "lazymar-b", "full-b", "disa", "marche")] == [
        True, True, False, False, False]
    assert zoo.speedup("full") == 1.0 and zoo.speedup("lazymar-b") > zoo.speedup("lazymar") > 1
    split = zoo.frechet_split()
    assert set(split.reuse) == {a for a in zoo.arms if zoo.reuses_head(a)} and "lazymar" in split.reuse_up
    fastest = split.fastest_kept
    assert fastest in split.kept and all(zoo.speedup(a) <= zoo.speedup(fastest) for a in split.kept)
    assert not set(split.kept) & set(split.other_up) and "full" not in split.kept + split.reuse
    with pytest.raises(ValueError, match=r"'zoo.json' is not a compare result \(format 'other'\)"):
        R.CompareResults("zoo.json", data={"format": "other"})


def _stage_file(tmp_path, monkeypatch, values: dict) -> "R.StageResults":
    """A training_stages.json of one quantity: ``values`` = {stage: (mean, lo, hi)}."""
    rows = [dict(stage=s, quantity="q", mean=m, lo=lo, hi=hi, n=10) for s, (m, lo, hi) in values.items()]
    (tmp_path / "training_stages.json").write_text(json.dumps(
        {"stages": {s: {"source": s} for s in values}, "settings": {}, "rows": rows}))
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    return R.StageResults()


@pytest.mark.parametrize("values, kind, words", [
    # the trained stages told apart: moves, with its direction
    ({"init": (1, 0.9, 1.1), "a": (2, 1.9, 2.1), "b": (3, 2.9, 3.1)}, "moves", "up `a` to `b`"),
    ({"init": (1, 0.9, 1.1), "a": (3, 2.9, 3.1), "b": (2, 1.9, 2.1)}, "moves", "down `a` to `b`"),
    # trained stages overlap, initialisation apart from the last: set by training
    ({"init": (1, 0.9, 1.1), "a": (2, 1.5, 2.5), "b": (2.2, 2.0, 2.4)}, "trained", "differs from initialisation"),
    # touching intervals are not told apart (a strict inequality), so everything overlaps: architecture
    ({"init": (1, 0.5, 1.5), "a": (2, 1.5, 2.5), "b": (1.2, 0.8, 1.6)}, "architecture", "initialisation: archit"),
])
def test_stage_verdicts_follow_disjoint_intervals(tmp_path, monkeypatch, values, kind, words):
    st = _stage_file(tmp_path, monkeypatch, values)
    assert st.kind("q") == kind
    assert words in st.verdict("q")
    assert st.of_kind(kind) == "*q*"
    assert "| q | 1.00 [" in st.table() and words in st.table()


def test_stage_reading_needs_two_trained_stages_and_drops_constants(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"stages \['init', 'a'\].*two trained stages"):
        _stage_file(tmp_path, monkeypatch, {"init": (1, 0.9, 1.1), "a": (2, 1.9, 2.1)})
    st = _stage_file(tmp_path, monkeypatch, {s: (0.2, 0.2, 0.2) for s in ("init", "a", "b")})
    assert st.kind("q") == "architecture" and st.of_kind("architecture") == ""


def test_stage_comparisons_hold_only_when_disjoint_at_every_trained_stage(tmp_path, monkeypatch):
    rows = [dict(stage=s, quantity=q, mean=m, lo=m - 0.1, hi=m + 0.1, n=10)
            for s, values in {"init": (0.5, 0.5, 0.5), "a": (0.9, 0.5, 0.55), "b": (0.8, 0.5, 0.3)}.items()
            for q, m in zip(("hi", "chance", "wobbly"), values)]
    (tmp_path / "training_stages.json").write_text(json.dumps(
        {"stages": {s: {"source": s} for s in ("init", "a", "b")}, "settings": {}, "rows": rows}))
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    st = R.StageResults()
    assert st.sign("hi", "chance") == 1 and st.sign("chance", "hi") == -1
    assert st.sign("hi", 0.65) == 1 and st.sign("hi", 0.75) == 0       # 0.8 +- 0.1 at b covers 0.75
    assert st.sign("wobbly", "chance") == 0                                # overlaps at a, below at b
    assert st.stage_signs("wobbly", 0.5) == [0, -1]                        # [0.45, 0.65] covers it; [0.2, 0.4] below
    assert st.where("wobbly", 0.5) == "not shown at `a`; reversed at `b`"
    assert st.where("hi", 0.75) == "holds at `a`; not shown at `b`"
    assert st.verdict("wobbly") == "moves with training: down `a` to `b`"


def test_a_move_between_distant_stages_is_named_when_no_neighbours_differ(tmp_path, monkeypatch):
    st = _stage_file(tmp_path, monkeypatch, {"init": (0, -0.1, 0.1), "a": (1, 0.9, 1.1), "b": (1.15, 0.95, 1.35),
                                             "c": (1.3, 1.2, 1.4)})
    assert st.kind("q") == "moves"
    assert st.verdict("q") == "moves with training: up `a` to `c`"


def test_the_model_card_finds_the_score_files_of_the_shipped_weights(tmp_path, monkeypatch):
    """Issue 14: the card reads the score that scored the shipped file's weights, by the SHA-256 each result file
    records, so the next phase ships with its own scores (or the card refuses to render), never a stale file name."""
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    for name, sha in (("s64_p27_t08.json", "a" * 64), ("s64_p28_t08.json", "b" * 64), ("s16_p28_t08.json", "b" * 64)):
        (tmp_path / name).write_text(json.dumps({"weights_sha256": sha, "rows": []}))
    ck = object.__new__(R.TrainingCheckpoint)                       # the file itself is not needed: its weights' SHA
    ck.rel, ck.__dict__["weights_sha256"] = "data/m.pth", "b" * 64
    assert ck.scored_file("s64_*_t08.json") == "s64_p28_t08.json"
    assert ck.scored_file("s16_*_t08.json") == "s16_p28_t08.json"
    ck.__dict__["weights_sha256"] = "c" * 64
    with pytest.raises(ValueError, match=r"expected one result file matching 's64_\*_t08.json' that scored "
                                         r"'data/m.pth' \(weights cccccccccccc…\), found \[\]"):
        ck.scored_file("s64_*_t08.json")
    (tmp_path / "s64_p27b_t08.json").write_text(json.dumps({"weights_sha256": "a" * 64}))
    ck.__dict__["weights_sha256"] = "a" * 64
    with pytest.raises(ValueError, match=r"found \['s64_p27_t08.json', 's64_p27b_t08.json'\]"):
        ck.scored_file("s64_*_t08.json")


def test_the_stage_table_says_when_its_final_file_holds_other_weights_since(monkeypatch):
    """The committed table's last stage names the shipped file: when a later phase has shipped into that file, the
    page names the SHA the table ran on; while the file still holds those weights, it says nothing."""
    st = R.StageResults()
    final = st.data["stages"][st.stages[-1]]
    monkeypatch.setattr(R, "weights_sha256_of", lambda path: final["weights_sha256"])
    assert st.final_replaced() is None
    monkeypatch.setattr(R, "weights_sha256_of", lambda path: "f" * 64)
    assert st.final_replaced() == final["weights_sha256"] and final["source"] == "data/fashion_b128.pth"


def test_speed_commands_are_the_recorded_ones_and_read_back_into_their_settings():
    """bench_strategies.py records its command; the pages print it broken into lines (shell_lines), and parsed by the
    script's own parser it gives the settings the file records (so a command typed beside a result cannot drift)."""
    import shlex

    import bench_strategies as BS
    for path in sorted(R.RESULTS.glob("strategies_*.json")):
        bench = R.BenchResults(path.name)
        if "command" not in bench.data:
            with pytest.raises(KeyError, match=rf"{path.name!r} records no command"):
                bench.command  # noqa: B018
            continue
        argv = shlex.split(bench.command)
        assert argv[:2] == ["python", "benchmarks/bench_strategies.py"], path.name
        args = BS.parser().parse_args(argv[2:])
        assert {k: getattr(args, k) for k in bench.settings} == bench.settings, path.name
        shown = R.shell_lines(bench.command)
        assert shlex.split(shown.replace(" \\\n", " ")) == argv
        lines = shown.removesuffix(" \\").split(" \\\n")
        assert all(len(line) <= 116 or len(shlex.split(line)) <= 2 for line in lines)    # longer: one flag's value
    assert "--tag frontier_b128_confirm " in R.BenchResults("strategies_vm_frontier_b128_confirm.json").command


def test_shell_lines_keep_a_flag_beside_its_value_and_quote_again():
    text = R.shell_lines("python x.py --a 1 --opt 'k=v;w=2' " + " ".join(f"--flag-{i} {i}" for i in range(20)),
                         width=40)
    lines = text.split(" \\\n")
    assert lines[0] == "python x.py --a 1 --opt 'k=v;w=2'" and all(len(line) <= 40 for line in lines)
    assert all(line.startswith("  --flag-") for line in lines[1:])


def test_a_checkpoints_weights_are_hashed_once_per_file_version(tmp_path, monkeypatch):
    """The model card and the stage table both ask for the shipped file's weights: one load per render, again after
    the file is replaced."""
    import mar_probe
    from mar_probe.probe.record import weights_sha256
    tiny, loads = mar_probe.create_model("mar_tiny"), []
    monkeypatch.setattr(mar_probe, "load_model", lambda path: loads.append(path) or tiny)
    weights = tmp_path / "w.pth"
    weights.write_bytes(b"a")
    assert R.weights_sha256_of(weights) == R.weights_sha256_of(str(weights)) == weights_sha256(tiny)
    assert len(loads) == 1
    weights.write_bytes(b"bb")                                    # a new version of the file
    R.weights_sha256_of(weights)
    assert len(loads) == 2


def test_a_phases_final_learning_rate_is_where_its_cosine_stopped():
    """The training card compares phases by the learning rate of their last iteration (issue 14, phase 29)."""
    from mar_probe.train import TrainConfig
    config = TrainConfig(iters=100, lr=1e-4, min_lr=1e-5, warmup_iters=10).to_dict()

    def phase(iterations):
        return R.Phase(index=1, config=config, start=0, seconds=(1.0,) * iterations, losses=(0.1,) * iterations)
    assert phase(100).final_lr == pytest.approx(1e-5, rel=0.01)          # completed: (nearly) at min_lr
    assert phase(56).final_lr == pytest.approx(5.5e-5)                    # iteration 55: half way down the cosine
    assert phase(5).final_lr == pytest.approx(5e-5)                       # iteration 4 of a 10-iteration warm-up
