"""Two benchmarks' own logic, without their hours of CPU: bench_train.py's variants are checked against the known
ones (the error lists them) and the CPU's bf16-related flags are read as booleans (issue 14: bf16 autocast paid on
one Xeon and not another); screen_sampling.py reuses an earlier screen's rows only for the same weights and
protocol, and refuses a malformed setting with the form it expects; time_study.py alternates the embedded default
and a candidate (issue 14: the study must still take about a minute on the new default) and takes their ratio;
compare_training_runs.py pairs two runs of one seed iteration by iteration (issue 14, phase 22's rate A/B) and refuses
runs that do not share their draws; ship_rehearsal.py switches a scratch tree's default to the candidate (issue 14:
every test must pass on the new default) and reads the suite's JUnit report; bench_strategies.py records the command
that ran it (the docs print it from the file)."""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import mar_probe.machine as M

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_strategies as BS  # noqa: E402
import bench_train as BT  # noqa: E402
import compare_training_runs as CT  # noqa: E402
import screen_sampling as SS  # noqa: E402
import ship_rehearsal as SR  # noqa: E402
import time_study as TS  # noqa: E402


def test_variants_keep_their_order_and_unknown_ones_are_refused_with_the_valid_ones():
    assert BT.parse_variants("explicit,explicit+fp32") == ("explicit", "explicit+fp32")
    assert BT.VARIANTS["explicit+fp32"]["amp"] == "none" and "amp" not in BT.VARIANTS["explicit"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown variant\(s\) \['fp16'\].*'explicit\+fp32'"):
        BT.parse_variants("explicit,fp16")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown"):
        BT.parse_variants(",")


def test_cpu_flags_are_booleans_for_exactly_the_flags_asked(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n")
    monkeypatch.setattr(M, "CPUINFO", info)
    assert M.cpu_flags(BT.BF16_FLAGS) == {"avx512_bf16": True, "amx_bf16": False, "amx_tile": False, "avx2": True}
    assert M.machine()["cpu"] == "Test CPU"  # the same reader gives the CPU's name
    monkeypatch.setattr(M, "CPUINFO", tmp_path / "absent")
    assert M.cpu_flags(("avx2",)) == {"avx2": False}


def test_a_screen_reuses_earlier_rows_only_for_the_same_weights_protocol_and_checkpoint(tmp_path):
    head = dict(command="c", checkpoint="m.pth", weights_sha256="ab", protocol=dict(per_class=20, steps=16, seed=1))
    rows = [dict(temperature=0.6, cfg=3.0, frechet_distance=63.4)]
    path = tmp_path / "screen.json"
    assert SS._earlier_rows(path, head) == []
    path.write_text(json.dumps(dict(head, command="an earlier call", rows=rows)))
    assert SS._earlier_rows(path, head) == rows  # another command line, same weights and protocol: reused
    for key, other in (("weights_sha256", "cd"), ("checkpoint", "n.pth"), ("protocol", dict(head["protocol"], seed=2))):
        assert SS._earlier_rows(path, dict(head, **{key: other})) == [], key


def test_the_screens_grid_takes_the_first_images_of_each_class_class_by_class():
    labels = [0, 1, 0, 2, 1, 0, 2, 2]
    assert SS.grid_order(labels, 2) == [0, 2, 1, 4, 3, 6]
    assert SS.grid_order(labels, 5) == [0, 2, 5, 1, 4, 3, 6, 7]  # a class with fewer images keeps what it has


def test_shards_keep_the_plain_seed_first_take_disjoint_seeds_and_class_balanced_labels():
    assert SS.shard_seeds(1, 1) == [1]  # one shard is the unsharded screen
    assert SS.shard_seeds(1, 3) == [1, 1001, 2001]
    with pytest.raises(ValueError, match="shards must be at least 1, got 0"):
        SS.shard_seeds(1, 0)
    assert SS.positive_int("2") == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"at least 1, got '{bad}'"):
            SS.positive_int(bad)
    labels = np.repeat(np.arange(3), 4)
    parts = SS.shard_labels(labels, 2)
    assert [np.bincount(p).tolist() for p in parts] == [[2, 2, 2], [2, 2, 2]]
    assert sorted(np.concatenate(parts).tolist()) == sorted(labels.tolist())


def test_a_sharded_screen_is_each_shards_own_sample_call_concatenated(tmp_path):
    import torch

    from mar_probe import create_model, sample
    model = create_model("mar_tiny").eval()
    path = tmp_path / "tiny.pth"
    torch.save({"model_ema": model.state_dict()}, path)
    labels = np.repeat(np.arange(2), 2)
    args = argparse.Namespace(checkpoint=str(path), shards=2, seed=5, steps=2, head_steps=None, batch_size=None,
                              threads=1)
    images, got_labels, settings = SS._sample(model, labels, 0.8, 2.0, args)
    want = [sample(model, part, num_iter=2, cfg=2.0, cfg_schedule="linear", temperature=0.8, seed=seed)
            for part, seed in zip(SS.shard_labels(labels, 2), (5, 1005))]
    np.testing.assert_array_equal(images, np.concatenate([w.images for w in want]))
    np.testing.assert_array_equal(got_labels, [0, 1, 0, 1])
    assert settings["seed"] == [5, 1005]


def test_screen_settings_parse_and_a_malformed_one_is_refused_with_the_form():
    assert SS.parse_settings("1.0:3.0,0.6:2.0") == ((1.0, 3.0), (0.6, 2.0))
    with pytest.raises(argparse.ArgumentTypeError, match=r"TEMPERATURE:CFG.*got '0.6-2.0'"):
        SS.parse_settings("0.6-2.0")


def test_the_study_timing_alternates_default_and_candidate_and_takes_the_ratio_of_medians(tmp_path, monkeypatch,
                                                                                        capsys):
    calls = []
    walls = iter([30.0, 45.0, 34.0, 60.0, 32.0, 48.0])

    def fake(out, nice=0, checkpoint=None, flags=()):
        calls.append((checkpoint, flags))
        return {"wall_s": next(walls), "checkpoint": checkpoint}

    monkeypatch.setattr(TS, "time_study", fake)
    record = TS.time_versus(tmp_path / "out", "cand.pth", rounds=3, flags=("--samples-per-seed", "1"))
    # alternating, so the load falls on both alike; the flags go to the candidate's runs only
    assert calls == [(None, ()), ("cand.pth", ("--samples-per-seed", "1"))] * 3
    assert record["flags"] == ["--samples-per-seed", "1"]
    assert record["median_wall_s"] == {"default": 32.0, "versus": 48.0} and record["ratio"] == 1.5
    assert [r["wall_s"] for r in record["versus"]] == [45.0, 60.0, 48.0]
    with pytest.raises(SystemExit):
        TS.main(["--versus", str(tmp_path / "absent.pth")])
    with pytest.raises(SystemExit):
        TS.main(["--versus-flags=--samples-per-seed 1"])  # flags for a candidate that is not named
    assert "--versus-flags '--samples-per-seed 1' needs --versus PATH" in capsys.readouterr().err


def _tiny_run(tmp_path, name, lr):
    from mar_probe.train import TrainConfig, train
    cfg = TrainConfig(preset="mar_tiny", dataset="digits", out_dir=str(tmp_path / name), iters=8, batch_size=8,
                      warmup_iters=2, ckpt_every=4, amp="none", threads=1, lr=lr, min_lr=lr / 10, seed=5)
    train(cfg)
    return tmp_path / name / "checkpoint-last.pth"


def test_two_runs_of_one_seed_see_the_same_draws_and_their_paired_difference_is_written(tmp_path, monkeypatch):
    base, same, other = (_tiny_run(tmp_path, n, lr) for n, lr in (("a", 1e-3), ("a2", 1e-3), ("b", 3e-3)))
    a, a2, b = CT.Run.read(base), CT.Run.read(same), CT.Run.read(other)
    assert np.array_equal(a.loss, a2.loss)  # the same seed and rate: the same run, bit for bit
    # iteration 0 is computed before any update: the same weights and draws whatever the rate
    assert a.loss[0] == b.loss[0] and not np.array_equal(a.loss, b.loss)
    same_window = CT.paired_difference(a, a2, 0, 8, block=2)["difference"]
    assert (same_window["estimate"], same_window["low"], same_window["high"]) == (0.0, 0.0, 0.0)
    win = CT.paired_difference(a, b, 2, 8, block=2)
    assert win["difference"]["n"] == 3 and win["second"] - win["first"] == pytest.approx(win["difference"]["estimate"])
    monkeypatch.setattr(CT, "RESULTS", tmp_path)
    monkeypatch.setattr(sys.modules["common"], "RESULTS", tmp_path)
    assert CT.main([str(base), str(other), "--block", "2", "--name", "ab"]) == 0
    data = json.loads((tmp_path / "ab.json").read_text())
    assert [r["config"]["lr"] for r in data["runs"]] == [1e-3, 3e-3] and (tmp_path / data["figure"]).is_file()
    assert [r["label"] for r in data["runs"]] == ["lr 1e-3 -> 1e-4", "lr 3e-3 -> 3e-4"]  # as the commands write them
    assert set(data["windows"]) == {"after warm-up", "last 300", "last 100"}


def test_runs_that_do_not_share_their_draws_or_a_window_too_short_are_refused(tmp_path):
    from mar_probe.train import TrainConfig
    loss = np.linspace(0.2, 0.1, 10)
    a = CT.Run(path="a.pth", config=TrainConfig(seed=1), loss=loss, seconds=np.arange(10.0))
    b = CT.Run(path="b.pth", config=TrainConfig(seed=2), loss=loss, seconds=np.arange(10.0))
    with pytest.raises(ValueError, match=r"differ in 'seed' \(1 vs 2\): a paired comparison needs the same init, seed"):
        CT.check_paired(a, b)
    with pytest.raises(ValueError, match=r"window \[0, 12\) must lie within the 10 iterations"):
        CT.paired_difference(a, a, 0, 12, block=2)
    with pytest.raises(ValueError, match="at least two blocks of 4"):
        CT.paired_difference(a, a, 0, 6, block=4)


def _scratch_tree(tmp_path, line):
    (tmp_path / "data").mkdir(parents=True)
    (tmp_path / "data/fashion_b128.pth").write_bytes(b"old")
    (tmp_path / "mar_probe/models").mkdir(parents=True)
    (tmp_path / "mar_probe/models/checkpoints.py").write_text(f"DATA_DIR = 1\n{line}\nOTHER = 2\n")
    return tmp_path


def test_the_rehearsal_puts_the_candidate_in_data_takes_the_old_default_out_and_points_the_library_at_it(tmp_path):
    real = (ROOT / "mar_probe/models/checkpoints.py").read_text()
    assert len(SR.DEFAULT_LINE.findall(real)) == 1  # the line the script edits is where the default lives today
    tree = _scratch_tree(tmp_path / "tree", 'DEFAULT_CHECKPOINT = DATA_DIR / "fashion_b128.pth"')
    candidate = tmp_path / "fashion_b192.pth"
    candidate.write_bytes(b"new")
    SR._switch_default(tree, candidate)
    assert (tree / "data/fashion_b192.pth").read_bytes() == b"new" and not (tree / "data/fashion_b128.pth").exists()
    assert (tree / "mar_probe/models/checkpoints.py").read_text() == (
        'DATA_DIR = 1\nDEFAULT_CHECKPOINT = DATA_DIR / "fashion_b192.pth"\nOTHER = 2\n')


def test_the_next_phase_of_the_default_model_replaces_its_file_and_leaves_the_library_line(tmp_path):
    line = 'DEFAULT_CHECKPOINT = DATA_DIR / "fashion_b128.pth"'
    tree = _scratch_tree(tmp_path / "tree", line)
    (tmp_path / "p28").mkdir()
    (tmp_path / "p28/fashion_b128.pth").write_bytes(b"phase 28")
    SR._switch_default(tree, tmp_path / "p28/fashion_b128.pth")
    assert (tree / "data/fashion_b128.pth").read_bytes() == b"phase 28"
    assert (tree / "mar_probe/models/checkpoints.py").read_text() == f"DATA_DIR = 1\n{line}\nOTHER = 2\n"


def test_the_rehearsal_refuses_a_tree_whose_default_is_set_elsewhere(tmp_path):
    tree = _scratch_tree(tmp_path / "tree", 'DEFAULT_CHECKPOINT = Path("data/fashion_b128.pth")')
    (tmp_path / "c.pth").write_bytes(b"new")
    with pytest.raises(RuntimeError, match="found 0"):
        SR._switch_default(tree, tmp_path / "c.pth")


def test_the_rehearsal_reads_outcomes_times_and_first_message_lines_from_the_junit_report(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.test_a" name="test_bad" time="0.25">'
        '<failure message="assert 1 == 2 in /tmp/x/tree/data/m.pth&#10;more">'
        '</failure></testcase><testcase classname="tests.test_b" name="test_skip" time="0">'
        '<skipped message="no GPU"/></testcase></testsuite></testsuites>')
    summary = SR._summary(SR._cases(junit, strip="/tmp/x/tree/"), slowest=2)
    assert summary["counts"] == {"passed": 1, "failure": 1, "error": 0, "skipped": 1}
    assert summary["failures"] == [{"id": "tests.test_a::test_bad", "seconds": 0.25, "outcome": "failure",
                                    "message": "assert 1 == 2 in data/m.pth"}]
    assert summary["slowest"] == [{"id": "tests.test_a::test_ok", "seconds": 1.5},
                                  {"id": "tests.test_a::test_bad", "seconds": 0.25}]


def test_the_rehearsal_records_the_pytest_options_the_tree_adds_and_the_suite_runs_in_two_workers(tmp_path):
    """Issue 14 (the suite under 20 minutes on 2 cores): the README's `python -m pytest -q` runs the files in two
    worker processes through pyproject's addopts, which the rehearsal's file records since the command hides them."""
    assert SR._addopts(ROOT) == "-ra -n 2 --dist loadfile"
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-x"\n')
    assert SR._addopts(tmp_path) == "-x"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert SR._addopts(tmp_path) == ""


def test_a_speed_run_records_its_command_which_parses_back_into_its_settings(tmp_path):
    import shlex
    argv = ["--tiny", "--rounds", "1", "--threads", "1", "--strategies", "b=lazymar", "--strategy-opt",
            "b.head_interval=2", "--tag", "t", "--out", str(tmp_path)]
    BS.main(argv)
    data = json.loads(next(tmp_path.glob("strategies_*_tiny_t.json")).read_text())
    assert data["command"] == shlex.join(["python", "benchmarks/bench_strategies.py", *argv])
    args = BS.parser().parse_args(shlex.split(data["command"])[2:])
    assert args.strategy_opt == data["settings"]["strategy_opt"] == ["b.head_interval=2"]
    assert data["results"]["b"]["strategy"]["head_interval"] == 2
