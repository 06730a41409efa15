"""Every notebook runs headless on CPU, top to bottom, with a small step count."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


# The quickstart runs in the default suite; the others (about 40 s each on 2 cores) with the slow tests.
@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=[] if p.stem == "quickstart" else [pytest.mark.slow], id=p.stem) for p in NOTEBOOKS]
)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_GRPO_STEPS", "4")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "clear outputs"
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert os.listdir(tmp_path), "the notebook wrote its runs under its working directory"
