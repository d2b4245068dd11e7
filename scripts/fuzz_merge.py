"""Add up ``gdn-lossless fuzz`` logs of one seed run in pieces (``--first-group``), per backend.

Checks that the pieces' groups cover ``[0, G)`` once each, and prints a table of what was tried and
what held (cases, geometries, D ranges, dtypes, writes, specials, corrupted slots, controls)::

    python scripts/fuzz_merge.py $OUT/fuzz/*.log        # the logs of scripts/gpu_x2.sh fuzz
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path


def parse(path: Path) -> dict:
    text = path.read_text()
    head = re.search(r"fuzz: (\d+) cases, backend (\w+), seed (\d+)", text)
    groups = re.search(r"shape groups \((\d+)\.\.(\d+)\), ([\d.]+) s", text)
    status = re.findall(r"exit status (\d+)", text)
    if not (head and groups and status):
        return {"path": path.name, "complete": False, "status": status[-1] if status else "?"}
    r = {"path": path.name, "complete": True, "cases": int(head[1]), "backend": head[2], "seed": int(head[3]),
         "groups": range(int(groups[1]), int(groups[2]) + 1), "seconds": float(groups[3]), "status": status[-1]}  # fmt: skip
    for key in ("geometries", "dtypes", "input kinds"):
        line = re.search(rf"^{key}\s+(.*)$", text, re.M)[1]
        r[key] = {k.strip(): int(v) for k, v in re.findall(r"([^,:]+?): (\d+)", line)}
    d = re.search(r"^D\s+.*cases per range: (.*)$", text, re.M)[1]
    r["D"] = {k.strip(): int(v) for k, v in re.findall(r"([\d-]+): (\d+)", d)}
    nums = {
        "requests": r"^requests\s+(\d+): (\d+) skipped",
        "writes": r"^slots\s+(\d+) accepted writes, (\d+) track writes.*?, (\d+) untouched",
        "specials": r"^specials\s+(\d+) NaN.* in (\d+) cases",
        "differing": r"outputs differing between record modes: (\d+) cases; inputs modified: (\d+)",
    }
    for k, pat in nums.items():
        r[k] = tuple(int(x) for x in re.search(pat, text, re.M).groups())
    held = re.search(r"^held\s+corrupted slots: (.*)$", text, re.M)[1]
    r["corrupted"] = {k: int(v) for k, v in re.findall(r"([\w/]+) (\d+)", held)}
    ctl = re.search(r"^controls\s+(.*)$", text, re.M)[1]
    r["controls"] = {k.strip(): (int(a), int(b)) for k, a, b in re.findall(r"([a-z ]+?) caught (\d+) of (\d+)", ctl)}
    return r


def _order(item):
    """D ranges by their first number, other names alphabetically."""
    k = item[0]
    return (0, int(k.split("-")[0]), "") if k.split("-")[0].isdigit() else (1, 0, k)


def main(paths: list[str]) -> int:
    logs = [parse(Path(p)) for p in paths]
    bad = [r for r in logs if not r["complete"]]
    for r in bad:
        print(f"incomplete (not counted): {r['path']}, exit status {r['status']}")
    by = collections.defaultdict(list)
    for r in logs:
        if r["complete"]:
            by[(r["backend"], r["seed"])].append(r)
    ok = not any(r["status"] != "0" for r in logs if r["complete"])
    for (backend, seed), rs in sorted(by.items()):
        groups = sorted(g for r in rs for g in r["groups"])
        dup = sorted(g for g, n in collections.Counter(groups).items() if n > 1)
        missing = sorted(set(range(max(groups) + 1)) - set(groups))

        def total(key):  # summed per name, zeros kept
            out = collections.defaultdict(int)
            for r in rs:
                for k, v in r[key].items():
                    out[k] += v
            return dict(out)

        add = lambda key: tuple(map(sum, zip(*(r[key] for r in rs))))  # noqa: E731
        controls = collections.defaultdict(lambda: [0, 0])
        for r in rs:
            for k, (a, b) in r["controls"].items():
                controls[k][0] += a
                controls[k][1] += b
        corrupted = total("corrupted")
        print(f"backend {backend}, seed {seed}: {sum(r['cases'] for r in rs)} cases in {len(groups)} shape groups "
              f"({len(rs)} commands; groups missing: {missing or 'none'}, twice: {dup or 'none'}), "
              f"{sum(r['seconds'] for r in rs):.0f} s of commands")  # fmt: skip
        for key in ("geometries", "D", "dtypes", "input kinds"):
            print(f"  {key:12} " + ", ".join(f"{k}: {v}" for k, v in sorted(total(key).items(), key=_order)))
        req, skip = add("requests")
        acc, trk, untouched = add("writes")
        spec, spec_cases = add("specials")
        diff, modified = add("differing")
        print(f"  requests     {req} ({skip} skipped entirely: slot or row out of range)")
        print(f"  slots        {acc} accepted writes, {trk} track writes, {untouched} untouched slots checked")
        print(f"  specials     {spec} NaN/Inf/signed-zero/subnormal values in {spec_cases} cases")
        print(
            f"  corrupted    {sum(corrupted.values())} ({', '.join(f'{k} {v}' for k, v in sorted(corrupted.items()))})"
        )
        print(f"  differing    outputs between record modes: {diff} cases; inputs modified: {modified}")
        print("  controls     " + ", ".join(f"{k} caught {a} of {b}" for k, (a, b) in controls.items()))
        ok &= not sum(corrupted.values()) and not diff and not modified and not missing and not dup
        ok &= all(a == b for a, b in controls.values())
    print("result       " + ("OK" if ok else "NOT OK"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
