# Two commands on a fresh machine (README): `make demo` (the main job) and `make test`.
# Both install what they need first (once): torch (the local CPU wheel where there is no torch yet),
# then this package with its dev and bench extras.
PY ?= python3
STAMP := .make-installed

.PHONY: install demo test test-gpu

$(STAMP): pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0 || $(PY) -m pip install torch
	$(PY) -m pip install -e ".[dev,bench]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m sparse_attn.cli.main demo

test: $(STAMP)
	$(PY) -m pytest -q

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu
