"""The code passes ruff with the project's configuration (pyproject.toml, [tool.ruff]); CI runs it with the tests."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: `pip install -e '.[test]'` installs it")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_would_catch_a_defect(tmp_path):
    """The check is real: the same configuration fails on an unused import and an undefined name."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           str(ROOT / "pyproject.toml"), str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1 and "F401" in proc.stdout and "F821" in proc.stdout
