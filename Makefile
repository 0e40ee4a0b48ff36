# Two commands do all the set-up from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU build these machines carry; the project declares a range.
$(STAMP): $(PY) pyproject.toml
	@echo "make: installing torch 2.13.0 (the CPU build) into $(VENV) ..."
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	@echo "make: installing hostmem (editable) with psutil, pyyaml, safetensors, tqdm, isal and, for the tests, pytest, hypothesis, diffusers, peft, transformers, accelerate ..."
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@echo "make: $(VENV) is ready"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hostmem demo --cgroup

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/run_all.py --write

clean:
	rm -rf $(VENV) build *.egg-info
