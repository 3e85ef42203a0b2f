"""Two benchmarks' own logic, without their hours of CPU: bench_train.py's variants are checked against the known
ones (the error lists them) and the CPU's bf16-related flags are read as booleans (issue 14: bf16 autocast paid on
one Xeon and not another); screen_sampling.py reuses an earlier screen's rows only for the same weights and
protocol, and refuses a malformed setting with the form it expects; time_study.py alternates the embedded default
and a candidate (issue 14: the study must still take about a minute on the new default) and takes their ratio."""
import argparse
import json
import sys
from pathlib import Path

import pytest

import mar_probe.machine as M

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_train as BT  # noqa: E402
import screen_sampling as SS  # noqa: E402
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
