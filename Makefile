PY ?= python3

.PHONY: install demo test test-gpu

install:
	$(PY) -m pip install torch==2.13.0 2>/dev/null || $(PY) -m pip install torch
	$(PY) -m pip install -e ".[dev,bench]"

demo:
	$(PY) -m sparse_attn.cli.main demo

test:
	$(PY) -m pytest -q -m "not gpu"

test-gpu:
	$(PY) -m pytest -q -m gpu
