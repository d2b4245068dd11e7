"""Importing jax-triton through the Triton backend leaves the process environment as it was.

jax-triton 0.3.1 sets ``os.environ["TRITON_CACHE_DIR"] = ""`` when imported, after which Triton
(>= 3.4) refuses every kernel compiled through its own runtime in the same process ("Could not
create or locate cache dir"). ``_lang.import_jax_triton`` imports it and puts ``os.environ`` back.
No GPU needed: a fake ``jax_triton`` package, written to ``tmp_path``, changes the environment as
the real one does (and more), and a control shows that a plain import of it does change it.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys

import pytest

from gdn_lossless_jax.backends.triton import _lang

ADDED = "GDN_TEST_JT_ADDED"  # the fake adds it
CHANGED = "GDN_TEST_JT_CHANGED"  # set before; the fake changes it
REMOVED = "GDN_TEST_JT_REMOVED"  # set before; the fake removes it

FAKE = f"""
import os
os.environ["TRITON_CACHE_DIR"] = ""
os.environ[{ADDED!r}] = "1"
os.environ[{CHANGED!r}] = "after"
os.environ.pop({REMOVED!r}, None)
FAIL = os.path.exists(os.path.join(os.path.dirname(__file__), "FAIL"))
if FAIL:  # as jax-triton does on a jaxlib without GPU support: the variable is set first
    raise ImportError("jax-triton requires JAX to be installed with GPU support (fake)")
def triton_call(*args, **kwargs):
    return os.environ.get("TRITON_CACHE_DIR")
"""


def _forget_jax_triton():
    for name in [n for n in sys.modules if n == "jax_triton" or n.startswith("jax_triton.")]:
        del sys.modules[name]


@pytest.fixture
def fake_jax_triton(tmp_path, monkeypatch):
    """A fake ``jax_triton`` first on ``sys.path``, the helper's memory of it cleared, and
    ``os.environ`` (which the control test changes) restored afterwards."""
    pkg = tmp_path / "jax_triton"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE)
    saved = dict(os.environ)
    saved_modules = {n: m for n, m in sys.modules.items() if n == "jax_triton" or n.startswith("jax_triton.")}
    _forget_jax_triton()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(_lang, "_JAX_TRITON", None)
    monkeypatch.setenv(CHANGED, "before")
    monkeypatch.setenv(REMOVED, "present")
    yield pkg
    _forget_jax_triton()
    sys.modules.update(saved_modules)
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("cache_dir", [None, "/tmp/gdn-triton-cache"], ids=["unset", "set"])
def test_helper_restores_environ(fake_jax_triton, monkeypatch, cache_dir):
    if cache_dir is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    before = dict(os.environ)
    jt = _lang.import_jax_triton()
    assert pathlib.Path(jt.__file__).parent == fake_jax_triton  # the fake, not an installed one
    assert dict(os.environ) == before
    assert os.environ.get("TRITON_CACHE_DIR") == cache_dir
    assert ADDED not in os.environ and os.environ[CHANGED] == "before" and os.environ[REMOVED] == "present"
    # the C environment (what a subprocess or Triton's C++ getenv sees) follows os.environ
    assert os.getenv("TRITON_CACHE_DIR") == cache_dir
    # the module works after the restore (the real one reads the variable only at import)
    assert jt.triton_call() == cache_dir


def test_plain_import_changes_environ(fake_jax_triton, monkeypatch):
    """The control: the same fake, imported plainly, does change the environment."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    before = dict(os.environ)
    importlib.import_module("jax_triton")
    assert dict(os.environ) != before
    assert os.environ["TRITON_CACHE_DIR"] == "" and os.environ[ADDED] == "1"
    assert os.environ[CHANGED] == "after" and REMOVED not in os.environ


def test_imported_once(fake_jax_triton):
    jt = _lang.import_jax_triton()
    _forget_jax_triton()  # a second import would execute the fake again, as a new module
    before = dict(os.environ)
    assert _lang.import_jax_triton() is jt
    assert "jax_triton" not in sys.modules and dict(os.environ) == before


def test_failed_import_restores_environ(fake_jax_triton):
    (fake_jax_triton / "FAIL").write_text("")
    before = dict(os.environ)
    with pytest.raises(ImportError, match="GPU support"):
        _lang.import_jax_triton()
    assert dict(os.environ) == before
    assert _lang._JAX_TRITON is None  # tried again next time
    (fake_jax_triton / "FAIL").unlink()
    _forget_jax_triton()
    assert _lang.import_jax_triton().FAIL is False
    assert dict(os.environ) == before


def test_package_imports_jax_triton_only_through_the_helper():
    """No module of the package imports ``jax_triton`` except ``_lang.import_jax_triton``."""
    root = pathlib.Path(_lang.__file__).parents[2]
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n == "jax_triton" or n.startswith("jax_triton.") for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
    assert '"jax_triton"' in pathlib.Path(_lang.__file__).read_text()
