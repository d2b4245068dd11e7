"""The committed benchmark results, read back (:mod:`gdn_lossless_jax.tools.viz`)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

__all__ = ["ResultFile", "find_results", "newest_results"]


# ---------------------------------------------------------------------------------
# Committed benchmark results.
# ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResultFile:
    """One ``results.json``: its ``kind`` (``"kernels"``: ``benchmarks.run``; ``"step"``:
    ``benchmarks.step``), when it was measured (as far as the file or its path says) and its data."""

    path: Path
    kind: str
    when: str
    data: dict

    @property
    def markdown(self) -> str | None:
        """The ``results.md`` written beside it, if any."""
        md = self.path.with_name("results.md")
        return md.read_text() if md.exists() else None


_DATE_IN_PATH = re.compile(r"(\d{4}-\d{2}-\d{2})([a-z]?)")


def _when(path: Path, data: dict) -> str:
    """A sortable time: the file's own date if it has one, else the date (and letter) in its path."""
    date = (data.get("meta") or {}).get("date") or (data.get("env") or {}).get("date")
    if date:
        return str(date)
    m = None
    for m in _DATE_IN_PATH.finditer(str(path)):
        pass
    return f"{m.group(1)}T00:00:00{m.group(2)}" if m else ""


def find_results(root: str | Path) -> list[ResultFile]:
    """Every benchmark ``results.json`` under ``root`` (e.g. ``benchmarks/results``), oldest first.

    Files that are not benchmark results (tuning logs, other JSON) are skipped.
    """
    found = []
    for path in sorted(Path(root).rglob("results.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            continue
        if "meta" in data and any("op" in r for r in rows):
            kind = "kernels"
        elif any("kind" in r and "wall" in r for r in rows) or "step" in path.parent.name:
            kind = "step"
        else:
            continue
        found.append(ResultFile(path, kind, _when(path, data), data))
    # Results of one day without a time of their own: a folder named "final..." is the later one,
    # "final" itself before its variants ("final-no-command-buffers").
    name = lambda r: r.path.parent.name  # noqa: E731
    return sorted(found, key=lambda r: (r.when, name(r).startswith("final"), -len(name(r)), str(r.path)))


def newest_results(root: str | Path, *, device: str | None = None) -> dict[str, ResultFile]:
    """The newest :class:`ResultFile` of each kind under ``root`` (a kind with none is absent),
    among those measured on a device whose name contains ``device`` (e.g. ``"H200"``), if given."""
    def on(r: ResultFile) -> str:
        return str((r.data.get("meta") or r.data.get("env") or {}).get("device", ""))

    return {r.kind: r for r in find_results(root) if device is None or device in on(r)}
