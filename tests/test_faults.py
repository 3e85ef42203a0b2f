"""The fast fault-injection suite (issue 19): the bad-input matrix of every command, kills at random moments.

The long versions (subprocesses, 20 kills) are ``benchmarks/fault_injection.py``; the corrupt-store matrix is
``tests/test_integrity.py``.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fault_cases import cases, prepare, run_case
from test_store import CLI, _assert_same_store, _done_count

CASES = cases()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("inputs"))


def test_the_matrix_covers_every_command_with_enough_cases():
    commands = {argv[0] for _, argv in CASES}
    assert commands == {"generate", "record", "compare", "sweep", "tune", "train", "quality", "analyze", "figures",
                        "study", "verify"}
    assert len(CASES) >= 112 and len({c for c, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("case, argv", CASES, ids=[c for c, _ in CASES])
def test_bad_input_exits_nonzero_in_two_lines_and_writes_nothing(case, argv, files, tmp_path):
    outcome = run_case(case, argv, files, tmp_path / "out")
    assert outcome.ok, f"{case}: {outcome.problems} (exit {outcome.rc})"


def test_kills_at_random_moments_then_resume_give_the_uninterrupted_store(tmp_path, ref_store):
    """SIGKILL at seeded random moments, the first before the store exists (during start-up and creation)."""
    delays = [0.3] + list(np.random.default_rng(19).uniform(1.0, 4.0, size=2))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for i, delay in enumerate(delays):
        out = tmp_path / f"k{i}.zarr"
        cmd = [sys.executable, "-m", "mar_probe.cli", "record", *CLI, "--out", str(out)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if i == 0:  # 0.3 s: still importing torch, so the rerun must start the store itself
            assert not out.exists() and _done_count(out) == 0
        rerun = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        _assert_same_store(out, ref_store)
        assert not list(tmp_path.glob(f".k{i}.zarr.tmp-*")), "a temporary folder was left behind"


@pytest.fixture(scope="module")
def ref_store(tmp_path_factory):
    from test_store import _record_ref
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    _record_ref(path)
    return path
