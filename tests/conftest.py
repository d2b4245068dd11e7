import os
import random
import zlib

# The CPU run (JAX_PLATFORMS=cpu, as `make test` sets it) compiles without LLVM's expensive passes:
# 13% of the suite's time (docs/testing.md), and the same bits (XLA:CPU emits no fast-math flags; the LLVM passes keep
# IEEE results). tests/test_compile_flags.py checks that against XLA's defaults. Set before JAX reads
# XLA_FLAGS (its first backend); a flag already in XLA_FLAGS is left as it is.
SUITE_XLA_FLAG = "--xla_llvm_disable_expensive_passes=true"
_xla_flags = os.environ.get("XLA_FLAGS", "")
if os.environ.get("JAX_PLATFORMS") == "cpu" and SUITE_XLA_FLAG.split("=")[0] not in _xla_flags:
    os.environ["XLA_FLAGS"] = f"{_xla_flags} {SUITE_XLA_FLAG}".strip()

import jax  # noqa: E402
import jax.experimental.pallas.fuser  # noqa: E402, F401
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Pallas registers three config options that enter every program's cache key (jax._src.pallas.core's on import, its
# fuser's when the first kernel lowers): imported above, before anything is traced, so that the first kernel call
# of a worker does not change the key of every program compiled before it (each would be traced and compiled again,
# and so would the program that made that call: a model step through Pallas, compiled twice).

# Tests compare bit patterns of float32 work: keep JAX's defaults (x64 off) everywhere.
jax.config.update("jax_enable_x64", False)

# Hypothesis profiles: "ci" (the default) keeps the property tests to a few minutes on 2 cores;
# "long" (HYPOTHESIS_PROFILE=long) runs LONG_FACTOR times the examples (tests set their CI
# count through examples(); others get 1000). Every example may compile new shapes (seconds
# on the CPU): no deadline.
LONG_FACTOR = 25
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", deadline=None, print_blob=True, suppress_health_check=_SLOW_OK)
settings.register_profile("long", parent=settings.get_profile("ci"), max_examples=1000)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


def examples(ci: int) -> int:
    """A property test's example count: ``ci`` in the CI profile, LONG_FACTOR times that in "long"."""
    return ci * (LONG_FACTOR if HYPOTHESIS_PROFILE == "long" else 1)


ON_GPU = jax.default_backend() == "gpu"

requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA or ROCm GPU (JAX default backend is not 'gpu')")

# GDN_FULL_TESTS=1: the extended parameter sets that the 2-core CI run leaves out (each feature they
# check is covered by a case that CI runs; docs/testing.md lists them). The GPU sessions export it.
FULL_TESTS = os.environ.get("GDN_FULL_TESTS", "") not in ("", "0")

full_only = pytest.mark.skipif(not FULL_TESTS, reason="extended set: GDN_FULL_TESTS=1 runs it (docs/testing.md)")


def pytest_configure(config):
    # Fresh seeds on every run, reproducible with GDN_SEED=<printed value>. Set before the
    # xdist workers start, so that they inherit it.
    os.environ.setdefault("GDN_SEED", str(random.randrange(1, 2**20)))
    # `-n N` without --dist: each worker takes a contiguous share of the tests, stealing from the others' ends once
    # it runs out ("worksteal"), instead of xdist's default of handing tests out a few at a time ("load"). Compiled
    # programs are kept per process, and a file's tests share most of theirs: spread over both workers, each
    # compiled them.
    given = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    explicit = any(a in ("-d", "--dist") or a.startswith(("--dist=", "--distload")) for a in given)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    # Tests marked `longest` (minutes each) run first: started late, one of them would hold the end
    # of an xdist run on one worker while the other idles. (Stable: the rest keep their order.)
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)


def pytest_terminal_summary(terminalreporter):
    # Also at the end: `make test` runs with -q, which hides the header.
    terminalreporter.write_line(f"GDN_SEED={os.environ['GDN_SEED']} (set it to reproduce this run's inputs)")


def pytest_report_header(config):
    return (
        f"jax {jax.__version__}, default backend {jax.default_backend()}; "
        f"GDN_SEED={os.environ['GDN_SEED']} (set it to reproduce this run's inputs); "
        f"hypothesis profile {HYPOTHESIS_PROFILE!r}"
    )


@pytest.fixture
def seed(request):
    """A seed per test: fresh per run (GDN_SEED), distinct per test id."""
    base = int(os.environ["GDN_SEED"])
    return (base * 1_000_003 + zlib.crc32(request.node.nodeid.encode())) % (2**31)
