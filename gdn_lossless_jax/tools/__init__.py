"""The tools around the library, apart from its core: the command line (:mod:`~.cli`,
``gdn-lossless``), the bit-exactness report (:mod:`~.check`), the commit fuzzer
(:mod:`~.fuzz`), the memory report (:mod:`~.memory`), the demo (:mod:`~.demo`) and the plots
(:mod:`~.viz`). Each is imported on first use (``gl.tools.memory``, ``from gdn_lossless_jax.tools import memory``)."""

import importlib

_TOOLS = ("accuracy", "amdgcn", "check", "cli", "demo", "fuzz", "fuzz_cases", "memory", "options", "viz")


def __getattr__(name: str):
    if name in _TOOLS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
