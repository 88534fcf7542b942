"""The notebooks in notebooks/ run top to bottom (so they never rot), in the test's Python.

To refresh the committed outputs after editing a notebook:
``python tests/test_notebooks.py --write`` (from the repository root).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "torchgrain-tests"
CELL_TIMEOUT = 180


def _kernel_dir() -> str:
    """A kernelspec that runs this very interpreter (the venv's), found via JUPYTER_PATH."""
    root = tempfile.mkdtemp(prefix="torchgrain-kernel-")
    spec = Path(root, "kernels", KERNEL)
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"torchgrain tests ({sys.executable})",
                "language": "python",
                "env": {
                    "PYTHONPATH": str(ROOT),
                    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
                },
            }
        )
    )
    return root


def execute(path: Path | nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4) if isinstance(path, Path) else path
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = _kernel_dir() + (os.pathsep + old if old else "")
    try:
        client = nbclient.NotebookClient(
            nb,
            kernel_name=KERNEL,
            timeout=CELL_TIMEOUT,
            # Wait for each cell's output messages as long as for the cell itself: on a
            # loaded machine they can arrive after nbclient's 4 s default, and a late
            # message is dropped silently (its text then missing from the notebook).
            iopub_timeout=CELL_TIMEOUT,
            # The kernel sends what a cell prints in pieces, cut wherever its I/O thread
            # flushes (every 0.2 s): on a loaded machine, in the middle of a print()'s
            # writes. One stream per cell keeps each printed line whole.
            coalesce_streams=True,
            resources={"metadata": {"path": str(ROOT)}},
        )
        client.execute()
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
    return nb


def _text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "performance.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: not executed"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))


_PRINT_IN_PIECES = """
import time

class Late:
    def __str__(self):
        time.sleep(1.0)  # the kernel sends what was printed so far meanwhile (every 0.2 s)
        return "True"

print("a line printed in pieces:", Late())
"""


def test_a_line_printed_in_pieces_is_found_whole():
    """What a loaded machine does once in a while to a print() (the kernel's I/O thread
    flushing between its writes), made certain: the line is still found whole."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(_PRINT_IN_PIECES)]
    text = _text(execute(nb))
    assert "a line printed in pieces: True" in text, text


@pytest.mark.slow
def test_quickstart_runs():
    nb = execute(ROOT / "notebooks" / "quickstart.ipynb")
    text = _text(nb)
    assert "1000 records in 4 shards" in text
    assert "a permutation: True" in text
    assert "identical across processes: True" in text
    assert "different next epoch:       True" in text
    assert "identical to the uninterrupted epoch: True" in text


@pytest.mark.slow
def test_performance_runs():
    nb = execute(ROOT / "notebooks" / "performance.ipynb")
    text = _text(nb)
    assert "naive" in text and "cache + workers" in text
    assert "Dataset.map_batch, per batch" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2


if __name__ == "__main__" and "--write" in sys.argv:
    for p in NOTEBOOKS:
        print(f"executing {p}")
        nbformat.write(execute(p), p)
