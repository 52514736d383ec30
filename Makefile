# Every target creates its own virtual environment and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEPLOYMENT ?= manifests/deployments/llama-3.1-70b-instruct-tp4-h100-sglang.toml

.PHONY: demo test lint bench-solve clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/detent-audit solve --deployment $(DEPLOYMENT)

test: $(VENV)/.installed lint
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench-solve: $(VENV)/.installed
	$(PY) benchmarks/solve.py

clean:
	rm -rf $(VENV) build *.egg-info
