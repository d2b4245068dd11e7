"""Benchmarks for gdn_lossless_jax: verify and commit timed against the memory-bandwidth floor.

Run ``python -m benchmarks.run --help`` from the repository root (with ``src`` on the path
or the package installed). The benchmark cases (geometry, request x draft configurations,
track-boundary fraction) are defined once in :mod:`benchmarks.cases` and shared with the
tests; byte counts live in :mod:`benchmarks.traffic`. See ``benchmarks/README.md``.

Importing this package imports nothing heavy (no JAX): ``benchmarks.run`` sets JAX's
memory options before it imports JAX.
"""
