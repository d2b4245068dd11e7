from gdn_lossless_jax.testing import controls
"""The CPU suite's compile flag gives the bits of XLA's defaults (tests/flag_digest.py).

``tests/conftest.py`` adds ``--xla_llvm_disable_expensive_passes=true`` to ``XLA_FLAGS`` for the
CPU run (the suite's time; docs/testing.md). The suite's checks compare programs compiled with it,
so they would not see a flag that changed a result everywhere alike: this test runs the library's
work (tests/flag_digest.py) in a process with XLA's defaults and compares the digests of every
result with this process's. Control: the digests see a one-rounding change (the twice-rounded replay
form) in one result and in no other.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ON_GPU, SUITE_XLA_FLAG as FLAG
from flag_digest import digests


@pytest.mark.skipif(
    ON_GPU or FLAG not in os.environ.get("XLA_FLAGS", "").split(),
    reason=f"the suite sets {FLAG} for a CPU run (JAX_PLATFORMS=cpu) only",
)
def test_suite_flag_keeps_the_bits_of_xla_defaults(seed):
    flags = os.environ["XLA_FLAGS"]
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags.split() if f != FLAG), JAX_PLATFORMS="cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, os.path.join(here, "flag_digest.py"), str(seed)], env=env, cwd=here,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    defaults = json.loads(run.stdout.strip().splitlines()[-1])
    ours = digests(seed)
    assert list(ours) == list(defaults)
    differ = [name for name in ours if ours[name] != defaults[name]]
    assert not differ, f"with {FLAG} these results differ from XLA's defaults: {differ}"

    from gdn_lossless_jax import rounding

    wrong = digests(seed, rule=controls.CONTROLS["twice_rounded"], last="reference replay")
    assert [n for n in wrong if wrong[n] != ours[n]] == ["reference replay"], "the control: the twice-rounded replay form"
