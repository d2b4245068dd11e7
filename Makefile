# On a fresh machine: `make demo` (the main job, on the CPU: speculative decoding in both record
# modes), `make check` (the bit-exactness report) and `make test` (the test suite). Each creates
# .venv with a Python >= 3.12 on first use.
# JAX=<version> pins jax and jaxlib to that release, in a venv of its own (.venv/jax-<version>): CI runs `make test`
# with the oldest jax pyproject.toml allows and again with the newest (.ci/run).
JAX ?=
VENV := $(if $(JAX),.venv/jax-$(JAX),.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo check test clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $$(scripts/python312.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' $(if $(JAX),'jax==$(JAX)' 'jaxlib==$(JAX)')
	@touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS-cpu} $(PY) -m gdn_lossless_jax demo $(ARGS)

check: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS-cpu} $(PY) -m gdn_lossless_jax check $(ARGS)

test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS-cpu} $(PY) -m pytest -n 2 -q --durations=10 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
