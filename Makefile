# Everyday entry points; CI runs `make test` through .ci/run.
PY ?= python3

.PHONY: install test test-fast check bench gpu-bundle

install:
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'

test:
	$(PY) -m pytest -q -n 2

test-fast:
	$(PY) -m pytest -q -m "not compile"

check:
	$(PY) -m flashtile check

bench:
	$(PY) -m flashtile bench

gpu-bundle:
	grep -qxF '/.carry/' .git/info/exclude || echo '/.carry/' >> .git/info/exclude
	bash ../shared/tools/make_gpu_bundle.sh .carry
