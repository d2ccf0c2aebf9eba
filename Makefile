# The two set-up commands of the README. Each creates the environment from the project's own files
# (pyproject.toml) on first use, so a fresh clone needs nothing but Python >= 3.11 and make.
#
#   make demo   the runtime only: the package and its dependencies (no `gpu`, `ner` or `dev` extra, no
#               Debian packages)
#   make test   on top of that, reusing it: the `dev` extra (test tools, Playwright, the `ner` and `gpu`
#               extras: PyTorch's CPU build), and the Debian packages the tests use (kcat, chromium)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed
# PyTorch (the `gpu` extra, part of `dev`) is pinned to 2.13.0; PyTorch's CPU wheel index is added so
# that pip takes the CPU build (~200 MB), not PyPI's CUDA one (GBs). TORCH_INDEX= skips it (a GPU machine:
# see docs/calibration.md).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test env runtime dagster dashboard

runtime: $(RUNTIME)
env: $(DEV)

$(RUNTIME): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "servelens needs Python >= 3.11: run make PYTHON=python3.11 ...")'
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(DEV): $(RUNTIME)
	$(BIN)/python -m pip install --quiet -e '.[dev]' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@# Debian packages the tests use: kcat (a C Kafka client) and chromium (the browser tests)
	@missing=""; \
	  command -v kcat >/dev/null 2>&1 || missing="$$missing kcat"; \
	  command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	  if [ -n "$$missing" ]; then SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    if command -v apt-get >/dev/null 2>&1; then \
	      echo "installing Debian packages:$$missing"; \
	      $$SUDO apt-get install -y -qq $$missing >/dev/null 2>&1 || { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; }; \
	    else echo "warning: install$$missing (the Kafka and browser tests need them)"; fi; fi
	touch $@

# The end-to-end path on embedded defaults and the bundled Azure conversation trace.
demo: $(RUNTIME)
	$(BIN)/servelens demo

# Lint, the type checker, then the whole test suite (the layering contract is tests/test_architecture.py;
# pytest exits non-zero when it collects no tests).
test: $(DEV)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

# The Dagster UI over the batch side (asset graph, partitions, checks, schedules) on 127.0.0.1:3000.
dagster: $(RUNTIME)
	$(BIN)/dagster dev -m pipelines.definitions

# The Streamlit dashboard on http://127.0.0.1:8501 over the lake, replay runs and gate reports (docs/dashboard.md).
dashboard: $(RUNTIME)
	$(BIN)/servelens dashboard $(DASHBOARD_ARGS)
