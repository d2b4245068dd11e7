"""Runnable documentation: every ```python block of README.md and docs/*.md runs as written, each
in a fresh namespace; every ``>>>`` example in the package's docstrings passes under doctest; the
documents link to files that exist and point to no document a user lacks.

A block that needs a GPU carries the line ``<!-- requires-gpu: <reason> -->`` right above its
fence; on a CPU it is skipped with that reason.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import shlex
from pathlib import Path

import pytest

import gdn_lossless_jax
from conftest import ON_GPU
from gdn_lossless_jax.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
GPU_MARK = re.compile(r"<!--\s*requires-gpu:\s*(.*?)\s*-->\s*$")


def _blocks(language: str):
    for path in DOCUMENTS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) != language:
                continue
            line = text.count("\n", 0, m.start()) + 2  # the block's first line of code
            above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            gpu = GPU_MARK.search(above)
            yield pytest.param(path, line, m.group(2), gpu.group(1) if gpu else None, id=f"{path.relative_to(ROOT)}:{line}")


def test_documents_have_python_blocks():
    assert len(list(_blocks("python"))) >= 8  # the README's decode step and at least one per design page
    assert (ROOT / "docs").is_dir() and len(DOCUMENTS) >= 8


@pytest.mark.parametrize("path, line, code, gpu_reason", list(_blocks("python")))
def test_python_block_runs(path, line, code, gpu_reason):
    if gpu_reason and not ON_GPU:
        pytest.skip(gpu_reason)
    # Padded so that a traceback names the document's own line numbers.
    compiled = compile("\n" * (line - 1) + code, str(path), "exec")
    exec(compiled, {"__name__": f"doc_block_{path.stem}_{line}"})


@pytest.mark.parametrize("path, line, text, _", [p for p in _blocks("console") if p.values[2].startswith("$ gdn-lossless memory")])
def test_memory_console_block_is_the_real_output(capsys, path, line, text, _):
    """The documents' ``gdn-lossless memory`` transcripts are what the command prints today."""
    command, *shown = text.rstrip("\n").split("\n")
    assert main(shlex.split(command)[2:]) == 0
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    assert [s for s in shown if s != "..."] == [p for p in printed if p in shown], f"{path}:{line}"
    assert all(s in printed for s in shown if s != "..."), f"{path}:{line}"


def _doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    for info in pkgutil.walk_packages(gdn_lossless_jax.__path__, "gdn_lossless_jax."):
        if info.name.endswith("__main__"):  # runs the command-line tool on import
            continue
        module = importlib.import_module(info.name)
        if module.__name__ != info.name:  # a moved module's old name (an alias): its doctests run under the new one
            continue
        for test in finder.find(module):
            if test.examples:
                yield pytest.param(test, id=test.name)


DOCTESTS = list(_doctests())


def test_public_docstrings_have_examples():
    assert len(DOCTESTS) >= 4


@pytest.mark.parametrize("test", DOCTESTS)
def test_docstring_examples(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
    assert runner.summarize(verbose=False).failed == 0


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_files_that_exist(path):
    for target in LINK.findall(path.read_text()):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"


# Documents a user of the package does not have: the project's design brief and research notes.
MISSING_DOCUMENTS = re.compile(r"SPEC\b|SPEC section|research section|/work/|shared/(?:SPEC|research|seed)")


def test_no_pointer_to_documents_a_user_lacks():
    files = [*DOCUMENTS, *sorted((ROOT / "gdn_lossless_jax").rglob("*.py"))]
    found = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if MISSING_DOCUMENTS.search(line)
    ]
    assert not found, "\n".join(found)
