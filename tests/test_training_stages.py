"""benchmarks/training_stages.py (issue 14, item 4) end to end on small models: every headline quantity per stage, a
stage read from a committed checkpoint (git:REV:PATH) with its weights' SHA-256, rows reused on a second call, and
a bad stage refused with what was expected. (It broke once unnoticed when study's recorder changed its arguments.)"""
import json
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import training_stages as TS  # noqa: E402

SMALL = ["--samples-per-seed", "2", "--compare-samples", "2", "--num-iter", "4", "--seeds", "0",
         "--compare-seeds", "0", "--layer", "0", "--lazymar-layer", "1", "--k", "4", "--threads", "1"]
QUANTITIES = 11


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    out, results = tmp_path_factory.mktemp("stages"), tmp_path_factory.mktemp("stage_results")
    argv = ["--stage", "init=init:mar_tiny", "--stage", "shipped=git:HEAD:data/fashion_b128.pth", *SMALL,
            "--out", str(out), "--results", str(results)]
    assert TS.main(argv) == 0
    return argv, out, results


def test_every_quantity_for_every_stage_and_the_committed_weights(stages):
    from mar_probe.models.checkpoints import load_model
    from mar_probe.probe.record import weights_sha256
    _, _, results = stages
    frame = pd.read_csv(results / "training_stages.csv")
    assert frame.groupby("stage").size().to_dict() == {"init": QUANTITIES, "shipped": QUANTITIES}
    assert (frame["lo"] <= frame["mean"]).all() and (frame["mean"] <= frame["hi"]).all()
    data = json.loads((results / "training_stages.json").read_text())
    assert data["stages"]["shipped"]["source"] == "git:HEAD:data/fashion_b128.pth"
    assert data["stages"]["shipped"]["weights_sha256"] == weights_sha256(load_model(ROOT / "data/fashion_b128.pth"))
    init = frame[frame["stage"] == "init"].set_index("quantity")["mean"]
    assert init["marche PSNR vs full (dB)"] == 100.0          # zero head at init: every strategy's image is full's
    assert (results / "training_stages.png").stat().st_size > 10_000


def test_a_second_call_reuses_the_rows(stages):
    argv, out, results = stages
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/rows.json")}
    first = pd.read_csv(results / "training_stages.csv")
    assert TS.main(argv) == 0
    assert len(before) == 2 and {p: p.stat().st_mtime_ns for p in out.glob("*/rows.json")} == before
    pd.testing.assert_frame_equal(pd.read_csv(results / "training_stages.csv"), first)


def test_reuse_takes_the_committed_rows_on_a_fresh_machine(stages, tmp_path):
    """--reuse FILE: a new out folder (a new machine) measures nothing for stages the file measured already."""
    argv, _, results = stages
    out, again = tmp_path / "out", tmp_path / "results"
    assert TS.main([*argv[:argv.index("--out")], "--out", str(out), "--results", str(again),
                    "--reuse", str(results / "training_stages.json")]) == 0
    assert not list(out.glob("*/rows.json"))                  # nothing measured again
    pd.testing.assert_frame_equal(pd.read_csv(again / "training_stages.csv"),
                                  pd.read_csv(results / "training_stages.csv"))


def test_reuse_matches_the_weights_under_any_name_and_refuses_other_weights_or_settings(stages):
    _, _, results = stages
    path = results / "training_stages.json"
    data = json.loads(path.read_text())
    s = TS.StageSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items()})
    source = data["stages"]["init"]
    assert len(TS.earlier_rows(path, "init", source, s)) == QUANTITIES
    assert TS.earlier_rows(path, "init", {**source, "weights_sha256": "0" * 64}, s) is None
    assert TS.earlier_rows(path, "init", source, TS.StageSettings(**{**s.__dict__, "k": s.k + 1})) is None
    renamed = TS.earlier_rows(path, "later", {**source, "source": "git:abc:elsewhere.pth"}, s)
    assert [r["stage"] for r in renamed] == ["later"] * QUANTITIES  # the same weights under another name and source
    assert [{**r, "stage": "init"} for r in renamed] == TS.earlier_rows(path, "init", source, s)
    assert TS.earlier_rows(None, "init", source, s) is None


def test_a_stage_that_git_cannot_show_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        TS.main(["--stage", "x=git:HEAD:data/nothing.pth", *SMALL, "--out", str(tmp_path),
                 "--results", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--stage x=git:HEAD:data/nothing.pth" in err and "expected REV:PATH of a committed checkpoint" in err
