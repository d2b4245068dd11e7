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
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    code = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    dirty = [i for i, c in code if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"{path.name}: cells {dirty} keep outputs; clear them before committing (Clear All Outputs)"


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path, kernel):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed to execute:\n{e}", pytrace=False)
    figures = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    print(f"{path.name}: {figures} figures in {time.perf_counter() - t0:.0f} s")
    assert figures >= 1, f"{path.name} executed but drew no figure"
