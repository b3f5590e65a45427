# Entry points.  `make demo` and `make test` are the README quick start; CI runs `make test`.
PY ?= python3
# A CPU machine gets the CPU wheel of torch; a machine that already has torch (e.g. a CUDA
# build on a GPU box) keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-dev demo test test-fast test-gpu precompile

install:
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .

install-dev: install
	$(PY) -m pip install -q -e '.[dev]'

demo: install
	$(PY) -m flashtile check
	$(PY) -m flashtile bench

test: install-dev
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-fast: install-dev
	$(PY) -m pytest -q -m "not compile"

test-gpu: install-dev
	$(PY) -m pytest -q -m gpu

precompile: install
	$(PY) -m flashtile.kernels.precompile
