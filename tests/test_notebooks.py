"""The notebooks (notebooks/*.py, jupytext percent format) run top to bottom in a fresh kernel, cwd = repo root.

Each notebook asserts the facts it shows, so a regression in mtx fails it here. The kernel is this interpreter
(a kernel spec written to a temporary JUPYTER_PATH), whatever other `python3` kernels the machine has.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
KERNEL = "mtx-notebook-python"


def _kernel_path(tmp_path: Path) -> Path:
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mtx (this interpreter)", "language": "python"}))
    return tmp_path


def test_every_notebook_is_collected():
    assert [p.name for p in NOTEBOOKS] == ["01_meshes_and_layouts.py", "02_column_then_row.py", "03_memory_wall.py",
                                           "04_pipeline_schedule.py", "05_comm_vs_compute.py"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    for module in ("jupytext", "nbclient", "ipykernel", "matplotlib"):
        pytest.importorskip(module, reason=f"{module} not installed: pip install -e '.[notebooks]'")
    import jupytext
    import nbclient

    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_path(tmp_path)))
    nb = jupytext.read(path)
    assert sum(cell.cell_type == "code" for cell in nb.cells) >= 3
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})  # any working directory
    client.execute()  # a cell that raises (a failed assertion included) raises CellExecutionError here
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors
