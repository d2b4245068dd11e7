"""The package's import graph is the DAG of layers ``pyproject.toml`` declares (docs/design.md).

import-linter checks the contract; the control is a contract that the package breaks (its
layers upside down), which the same check must report."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
importlinter = pytest.importorskip("importlinter.cli", reason="needs import-linter (the test extra)")


def _lint(config: Path) -> bool:
    sys.path.insert(0, str(ROOT))  # the checkout's package, also where another one is installed
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        return importlinter.lint_imports(config_filename=str(config), no_cache=True, no_logo=True) == 0
    finally:
        os.chdir(cwd)
        sys.path.remove(str(ROOT))


def test_layers_kept():
    assert _lint(ROOT / "pyproject.toml")


def test_layers_control(tmp_path):
    """The check must catch an import running up: the same layers, upside down."""
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("layers = [")
    end = text.index("]", start)
    layers = [line.strip().rstrip(",") for line in text[start:end].splitlines()[1:] if line.strip()]
    flipped = "layers = [\n" + "".join(f"    {layer},\n" for layer in reversed(layers))
    config = tmp_path / "pyproject.toml"
    config.write_text(text[:start] + flipped + text[end:])
    assert not _lint(config)
