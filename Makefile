# Two commands do everything on a fresh machine: `make check` (the main job, on the CPU)
# and `make test` (the test suite). Both create .venv with a Python >= 3.12 on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: check test clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $$(scripts/python312.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

check: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS-cpu} $(PY) -m gdn_lossless_jax check $(ARGS)

test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS-cpu} $(PY) -m pytest -n 2 -q --durations=10 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
