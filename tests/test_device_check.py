"""benchmarks/device_check.sh (issue 16): its CPU dry run passes every step and writes the summary, the JSON and the
machine description it promises; a failing step is reported, the script goes on and exits non-zero; the budget caps
the whole run. The dry run takes about 1-2 minutes on the shared 2-core machine."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mar_probe import strategies

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STEPS = ["machine", "tests", "generate", "strategies", "strategies:speedups", "record", "record:throughput",
         "torchrun", "torchrun:verify"]
STATUSES = {"ok", "FAIL", "timeout", "skipped"}


def run_script(out, *args, env=None, timeout=330):
    """``bash benchmarks/device_check.sh --device cpu`` with this interpreter, one torch thread, into ``out``."""
    base = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--python", sys.executable, "--out", str(out),
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**base, "OMP_NUM_THREADS": "1", **(env or {})})


def summary_rows(text: str) -> dict:
    """The step table of summary.md: {step: (status, exit code, seconds)}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[1] in STATUSES:
            rows[cells[0]] = (cells[1], int(cells[2]), float(cells[3]))
    return rows


def expected_steps() -> list:
    return STEPS[:3] + [f"generate:{n}" for n in strategies.available()] + STEPS[3:]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    proc = run_script(out)
    assert (out / "device_check.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out, json.loads((out / "device_check.json").read_text()), (out / "summary.md").read_text()


def test_dry_run_passes_every_step(dry_run):
    proc, out, result, _ = dry_run
    steps = {s["name"]: s for s in result["steps"]}
    assert list(steps) == expected_steps()                    # in order, every strategy its own generate row
    failed = {n: s for n, s in steps.items() if s["status"] != "ok"}
    others = {n: s for n, s in failed.items() if not n.startswith("torchrun")}
    assert not others, (others, proc.stdout[-3000:], proc.stderr[-3000:])
    if failed:                                                # only torchrun failed: the exit code says so
        assert proc.returncode == 1 and result["failed"] == len(failed) and result["passed"] is False
        if importlib.util.find_spec("mar_probe.__main__") is None:
            pytest.xfail("torchrun support has not landed: `torchrun -m mar_probe` needs mar_probe/__main__.py; "
                         f"the torchrun steps failed: {sorted(failed)}")
        pytest.fail(f"the torchrun steps failed: {failed}\n{(out / 'logs' / 'torchrun.log').read_text()[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["failed"] == 0 and result["passed"] is True
    assert result["seconds"] < result["budget_s"] == 240


def test_summary_lists_every_step_with_status_and_seconds(dry_run):
    _, _, result, summary = dry_run
    rows = summary_rows(summary)
    assert list(rows) == expected_steps()
    for step in result["steps"]:
        status, rc, seconds = rows[step["name"]]
        assert (status, rc) == (step["status"], step["rc"]) and seconds == pytest.approx(step["seconds"])
        assert seconds >= 0 and (rc == 0) == (status == "ok")
    n = len(rows)
    fails = [k for k, v in rows.items() if v[0] != "ok"]
    assert (f"**All {n} steps passed.**" in summary) if not fails else (f"**{len(fails)} of {n} steps failed:**"
                                                                        in summary)
    assert "## Speed-ups over full" in summary and "## Recording throughput" in summary and "## Machine" in summary


def test_json_holds_speedups_throughput_and_machine(dry_run):
    _, out, result, _ = dry_run
    assert result["device"] == "cpu" and result["dry_run"] is True
    speedups = result["speedups"]["speedups"]
    assert set(speedups) == set(strategies.available())
    for name, row in speedups.items():
        for key in ("end_to_end", "end_to_end_median", "transformer", "flop_ratio"):
            v = row[key]
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (name, key, v)
    assert speedups["full"]["end_to_end"] == 1.0 and result["speedups"]["settings"]["device"] == "cpu"
    models = result["record"]["models"]
    assert set(models) == {"default", "mar_base"} and result["record"]["device"] == "cpu"
    for name, row in models.items():
        assert row["logical_mib_per_s"] > 0 and row["raw_disk_mib_per_s"] > 0, name
        assert 0 < row["fraction_of_raw_disk"] == pytest.approx(row["logical_mib_per_s"] / row["raw_disk_mib_per_s"],
                                                               rel=1e-6), name
    machine = result["machine"]
    assert machine["torch"] == torch.__version__ and machine["cuda_available"] == torch.cuda.is_available()
    text = (out / "machine.txt").read_text()
    assert "## nvidia-smi" in text and "## lscpu" in text and torch.__version__ in text
    for name in strategies.available():                       # mar-probe generate wrote each strategy's samples
        assert (out / "generate" / name / "samples.npz").is_file(), name
    if not torch.cuda.is_available():                         # the cuda tests were collected, and skipped
        tests = next(s for s in result["steps"] if s["name"] == "tests")
        assert "skipped" in tests["detail"] and "passed" not in tests["detail"], tests


def test_a_failing_step_is_reported_and_the_script_goes_on(tmp_path):
    """pytest refuses an unknown flag (exit code 4): the tests step fails, strategies still runs, the exit is 1."""
    proc = run_script(tmp_path, "--only", "tests,strategies", env={"PYTEST_ADDOPTS": "--no-such-flag"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    steps = {s["name"]: s for s in result["steps"]}
    assert list(steps) == ["tests", "strategies", "strategies:speedups"]
    assert (steps["tests"]["status"], steps["tests"]["rc"]) == ("FAIL", 4)
    assert steps["strategies"]["status"] == steps["strategies:speedups"]["status"] == "ok"
    assert result["failed"] == 1 and result["passed"] is False and result["speedups"]["speedups"]["full"]
    summary = (tmp_path / "summary.md").read_text()
    assert "**1 of 3 steps failed:** tests." in summary and summary_rows(summary)["tests"][:2] == ("FAIL", 4)
    assert "--no-such-flag" in (tmp_path / "logs" / "tests.log").read_text()


def test_a_broken_python_fails_its_steps_but_the_summary_is_written(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--python", str(tmp_path / "no-python"), "--out",
                           str(tmp_path), "--only", "machine,torchrun"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 1
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert [(s["name"], s["status"]) for s in result["steps"]] == [
        ("machine", "FAIL"), ("torchrun", "FAIL"), ("torchrun:verify", "FAIL")]
    assert result["steps"][0]["rc"] == 127 and "no-python" in result["steps"][0]["detail"]
    assert result["machine"] is None and result["speedups"] is None
    assert "## lscpu" in (tmp_path / "machine.txt").read_text()  # the part that needs no Python is there
    assert "**3 of 3 steps failed:** machine, torchrun, torchrun:verify." in (tmp_path / "summary.md").read_text()


def test_the_budget_caps_the_whole_run(tmp_path):
    """Each step's timeout is what is left of --budget: a step past it is killed, later ones are not started."""
    proc = run_script(tmp_path, "--only", "tests,strategies", "--budget", "10", timeout=120)
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["seconds"] <= 10 + 12                       # the budget, and timeout's --kill-after grace
    bad = [s for s in result["steps"] if s["status"] != "ok"]
    assert all(s["status"] in ("timeout", "skipped") for s in bad), bad
    assert (proc.returncode == 1) == bool(bad) and all(s["limit_s"] <= 10 for s in result["steps"])


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "unknown device 'tpu'; expected 'cuda' or 'cpu'"),
    (["--only", "tests,bogus"], "unknown step 'bogus' in --only; expected some of: machine, tests, generate"),
    (["--budget", "5s"], "--budget must be a whole number of seconds, got '5s'"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])
def test_bad_arguments_name_the_bad_value(tmp_path, args, message):
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "out"), *args], capture_output=True,
                          text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and not (tmp_path / "out").exists()
