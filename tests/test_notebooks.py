"""Every notebook under notebooks/ executes top to bottom (nbclient, a kernel of this Python) and
draws at least one figure; the committed notebooks carry no outputs.

The kernel is this interpreter (a kernel spec written for the run, so a user's own ``python3``
kernel cannot stand in), with this environment: ``JAX_PLATFORMS=cpu`` from ``make test`` reaches
the notebooks too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "gdn-lossless-test"


def test_the_notebooks_are_there():
    names = {p.stem for p in NOTEBOOKS}
    assert {"rounding", "memory", "speculative_decoding", "performance"} <= names, names
    assert (ROOT / "notebooks" / "README.md").exists()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_their_figures(path):
    """The notebooks are committed executed, so that a reader who does not run them sees the figures
    (notebooks/README.md says how to refresh them); CI executes them again below."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    figures = [o for c in code for o in c.get("outputs", ()) if "image/png" in o.get("data", {})]
    assert figures, f"{path.name}: no figure in its outputs; execute it before committing (notebooks/README.md)"
    assert all(c.get("outputs") is not None for c in code)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel spec for this interpreter, found through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(root / "kernels" / KERNEL, overrides={"display_name": "gdn_lossless_jax tests"})
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(root) + (os.pathsep + old if old else "")
    yield KERNEL
    if old is None:
        os.environ.pop("JUPYTER_PATH")
    else:
        os.environ["JUPYTER_PATH"] = old


# The suite runs these notebooks with fewer generated tokens (the same cells and code paths; the suite's time): each
# substitution must match a code cell, so that an edit of the notebook cannot drop one unnoticed.
REDUCED = {"speculative_decoding": [("NEW = 300", "NEW = 100"), ("new=150)", "new=50)")]}


def _execute(path: Path, kernel: str, cwd: Path) -> list:
    """Run the notebook in ``cwd`` (with :data:`REDUCED`'s substitutions); returns its outputs (fails the test on a
    cell's error)."""
    nb = nbformat.read(path, as_version=4)
    for old, new in REDUCED.get(path.stem, ()):
        cells = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        assert cells, f"{path.name}: no code cell holds {old!r} (tests/test_notebooks.py, REDUCED)"
        for c in cells:
            c.source = c.source.replace(old, new)
    client = NotebookClient(nb, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed to execute:\n{e}", pytrace=False)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    print(f"{path.name}: {_figures(outputs)} figures in {time.perf_counter() - t0:.0f} s")
    return outputs


def _figures(outputs) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path, kernel):
    assert _figures(_execute(path, kernel, path.parent)) >= 1, f"{path.name} executed but drew no figure"


def test_performance_notebook_without_the_repository(kernel, tmp_path):
    """Outside a clone (no benchmarks/results/ above it) the notebook says so and still runs."""
    outputs = _execute(ROOT / "notebooks" / "performance.ipynb", kernel, tmp_path)
    text = "".join(o.get("text", "") for o in outputs)
    assert "none: this notebook needs the repository's benchmarks/results/" in text
    assert "No step benchmark results found" in text and _figures(outputs) >= 1
