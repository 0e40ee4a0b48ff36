# Two commands do all the set-up from a clean clone: `make demo` and `make test`.
# `make demo` installs only what the demo runs (the package and its runtime dependencies);
# `make test` adds the test extra (pytest, hypothesis, sybil and the real clients the
# tests compare against). Each has its own stamp, so either may come first. --no-compile:
# Python compiles what a run imports when it imports it, instead of all of torch up front
# (140 MiB of .pyc the demo never reads).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU build these machines carry; the project declares a range.
$(RUNTIME_STAMP): $(PY) pyproject.toml
	@echo "make: installing torch 2.13.0 (the CPU build) into $(VENV) ..."
	$(PIP) torch==2.13.0
	@echo "make: installing hostmem (editable) with safetensors, psutil, pyyaml, tqdm, isal, blake3 ..."
	$(PIP) -e .
	@echo "make: $(VENV) is ready for the demo"
	touch $(RUNTIME_STAMP)

$(TEST_STAMP): $(RUNTIME_STAMP)
	@echo "make: installing the test extra: pytest, pytest-xdist, hypothesis, sybil, diffusers, peft, transformers, accelerate, lycoris-lora ..."
	$(PIP) -e '.[test]'
	@echo "make: compiling the installed packages' bytecode once (the tests start hundreds of processes) ..."
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@echo "make: $(VENV) is ready for the tests"
	touch $(TEST_STAMP)

demo: $(RUNTIME_STAMP)
	$(VENV)/bin/hostmem demo --cgroup

# The suite runs on every core (pytest-xdist); tests marked `alone` run after it, by
# themselves (exit 5, "none selected", is no failure). Bytecode is compiled ahead: where
# PYTHONDONTWRITEBYTECODE is set, every process a test starts would otherwise compile
# torch, diffusers and the project from source (about 10 s once against minutes per run).
test: $(TEST_STAMP)
	$(PY) -m compileall -q -j 0 hostmem lora_cache planners tests > /dev/null
	$(PY) -m pytest -q -n auto -m "not alone"
	$(PY) -m pytest -q -m alone || [ $$? -eq 5 ]

bench: $(TEST_STAMP)
	$(PY) bench/run_all.py --write

clean:
	rm -rf $(VENV) build *.egg-info
