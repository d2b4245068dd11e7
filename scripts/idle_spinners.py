"""Run a command while every CPU is kept out of its idle state by a process of the lowest priority.

On a machine whose idle CPUs halt (a virtual machine without a cpuidle driver, for one), a jitted JAX call
that follows a millisecond or more in which JAX had nothing to do pays for waking JAX's runtime threads on
halted CPUs (0.15-0.35 ms a call on an H200 host). With every CPU kept busy at the lowest priority that
cost goes away, so back-to-back timings measure the step, not the wake-ups (``docs/step.md``).

Each spinner is pinned to one CPU and runs under ``SCHED_IDLE`` (Linux' lowest class: any other thread
that wakes on its CPU preempts it at once, and the scheduler counts such a CPU as idle when it places a
woken thread), so no CPU ever halts and no thread waits for one. ``--policy nice`` runs them at nice
19 in the normal class instead; ``--policy pause`` likewise, each a C loop of x86 ``pause`` instructions
(built with ``cc`` into a temporary folder), which leaves more of a shared core to its other hardware
thread than Python's loop does::

    python scripts/idle_spinners.py -- python -m benchmarks.step --out /tmp/step ...
    python scripts/idle_spinners.py --cpus 0-7 --policy nice -- python -m benchmarks.step ...

The command's exit status is returned; the spinners are killed when it ends.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile


def parse_cpus(text: str | None) -> list[int]:
    if not text:
        return sorted(os.sched_getaffinity(0))
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


PAUSE_LOOP = "#include <immintrin.h>\nint main(void) { for (;;) _mm_pause(); }\n"


def build_pause_loop(folder: str) -> str:
    """The ``pause`` spinner, compiled with ``cc``: its path."""
    src, exe = os.path.join(folder, "pause_loop.c"), os.path.join(folder, "pause_loop")
    with open(src, "w") as f:
        f.write(PAUSE_LOOP)
    subprocess.run(["cc", "-O2", "-o", exe, src], check=True)
    return exe


def spin(cpu: int, policy: str, exe: str | None) -> None:  # in the child: never returns
    os.sched_setaffinity(0, {cpu})
    if policy == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)
    if exe:
        os.execv(exe, [exe])  # keeps the affinity and the nice value
    while True:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", help="CPUs to keep busy, e.g. 0-15 or 0,2,4 (default: all this process may use)")
    ap.add_argument("--policy", choices=("idle", "nice", "pause"), default="idle",
                    help="idle: SCHED_IDLE Python loops; nice: nice-19 Python loops; pause: nice-19 C pause loops")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given (write it after --)")
    cpus = parse_cpus(a.cpus)
    if a.policy == "pause" and platform.machine() not in ("x86_64", "AMD64"):
        ap.error(f"--policy pause runs x86 pause instructions; this machine is {platform.machine()}")
    tmp = tempfile.TemporaryDirectory()
    exe = build_pause_loop(tmp.name) if a.policy == "pause" else None
    pids = []
    for cpu in cpus:
        pid = os.fork()
        if pid == 0:
            try:
                spin(cpu, a.policy, exe)
            finally:
                os._exit(1)
        pids.append(pid)
    print(f"idle_spinners: {len(pids)} spinners ({a.policy}) on CPUs {cpus}, pids {pids}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
