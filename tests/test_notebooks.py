"""The notebooks: stored without outputs, and every one runs top to bottom (``MAR_PROBE_FAST=1``) without a
cell error. 06 runs twice: skipping without ImageNet files, and through its study on a tiny latent checkpoint."""
import json
import os
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel the notebooks run in; part of the `test` extra)
import nbclient
import nbformat
import pytest

NB_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
EXPECTED = ["01_quickstart", "02_token_redundancy", "03_condition_redundancy", "04_selection_vs_drift",
            "05_strategy_tradeoffs", "06_imagenet_models"]


def test_all_notebooks_present():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: cells {dirty!r} have outputs or execution counts; clear them "
                       "(JupyterLab: Edit > Clear Outputs of All Cells) or rerun notebooks/make_notebooks.py")
    assert "widgets" not in nb.metadata, (f"{path.name} stores widget state; save it without "
                                          "(Settings > Save Widget State)")


def _execute(path, tmp_path, monkeypatch, **env):
    """Run a notebook in a fresh kernel in ``tmp_path``; any cell error raises CellExecutionError."""
    monkeypatch.setenv("MAR_PROBE_FAST", "1")
    monkeypatch.setenv("MAR_PROBE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("MAR_PROBE_ROOT", str(tmp_path))  # 06: no pretrained_models/ there
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    for key in ("MAR_CHECKPOINT", "MAR_PRESET", "MAR_VAE"):  # 06 reads these; only the test sets them
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") + json.dumps(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nb = _execute(path, tmp_path, monkeypatch)
    text = _text(nb)
    assert "FAST=True" in text
    if path.stem == "06_imagenet_models":
        assert "SKIPPED: no MAR checkpoint" in text and "checkpoint-last.pth" in text
    elif path.stem == "05_strategy_tradeoffs":
        assert (tmp_path / "runs" / "05_compare" / "results.json").is_file()
        assert (tmp_path / "runs" / "05_sweep" / "sweep.csv").is_file()
    else:
        assert (tmp_path / "runs" / f"{path.stem}.zarr").is_dir()
    if path.stem in ("02_token_redundancy", "05_strategy_tradeoffs"):  # the widgets were displayed
        assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                   for c in nb.cells for o in c.get("outputs", []))


def test_imagenet_notebook_study_on_a_tiny_latent_checkpoint(tmp_path, monkeypatch):
    """06's study path, with a random 3+3-block latent MAR standing in for MAR-B (no VAE: tokens only)."""
    import torch

    import mar_probe
    torch.manual_seed(0)
    model = mar_probe.create_model("mar_tiny_latent", name="tiny3", encoder_depth=3, decoder_depth=3)
    ckpt = tmp_path / "tiny.pth"
    torch.save({"model_ema": model.state_dict(), "mar_probe_config": model.config.to_dict()}, ckpt)
    nb = _execute(NB_DIR / "06_imagenet_models.ipynb", tmp_path, monkeypatch, MAR_CHECKPOINT=str(ckpt), MAR_PRESET="")
    text = _text(nb)
    assert "SKIPPED" not in text and "absent (tokens only)" in text and "more stable than cond" in text
    assert (tmp_path / "runs" / "06_tiny3.zarr").is_dir()
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})  # the explorer on latent tokens
               for c in nb.cells for o in c.get("outputs", []))
