# Two commands set everything up on a fresh machine with Python 3.11:
#   make serve   -- create .venv, install jaxcb, start the server on the embedded tiny model
#   make test    -- create .venv with the test and dist (Ray) extras, run the whole test suite
# Extra Hydra overrides go in ARGS, e.g. make serve ARGS="model=llama8b model.init=random".

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
# Two pytest workers (pytest-xdist): most tests are bound by one-threaded XLA compiles.
PYTEST_ARGS ?= -n 2

.PHONY: serve test generate clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test,dist]'
	touch $(VENV)/.installed $@

serve: $(VENV)/.installed
	$(PY) scripts/serve.py $(ARGS)

generate: $(VENV)/.installed
	$(PY) scripts/generate.py $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
