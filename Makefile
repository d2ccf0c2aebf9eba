# The two set-up commands of the README. Each creates the environment from the project's own files
# (pyproject.toml) on first use, so a fresh clone needs nothing but Python >= 3.11 and make.
#
#   make demo   the runtime only: the package and its dependencies (no `gpu`, `ner` or `dev` extra, no
#               Debian packages)
#   make test   on top of that, reusing it: the `dev` extra (test tools, Playwright, the `ner`, `gpu` and
#               `scaleout` extras: PyTorch's CPU build), and the Debian packages the tests use (kcat,
#               chromium, postgresql)
#   make lock   regenerate the lock files requirements/*.txt from pyproject.toml (uv pip compile)
#
# Every install is constrained by a lock file, so each machine gets the same versions: the runtime by
# requirements/runtime.txt, the dev environment by requirements/dev.txt; the image (Dockerfile) installs
# requirements/image.txt (the runtime and the scaleout extra). Versions move only with `make lock`
# (`make lock LOCK_FLAGS=--upgrade` to take the newest allowed by pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed
# PyTorch (the `gpu` extra, part of `dev`) is pinned to 2.13.0; PyTorch's CPU wheel index is added so
# that pip takes the CPU build (~200 MB), not PyPI's CUDA one (GBs). TORCH_INDEX= skips it (a GPU machine:
# see docs/calibration.md).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test env runtime dagster dashboard lock

runtime: $(RUNTIME)
env: $(DEV)

$(RUNTIME): pyproject.toml requirements/runtime.txt Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "servelens needs Python >= 3.11: run make PYTHON=python3.11 ...")'
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements/runtime.txt -e .
	touch $@

$(DEV): $(RUNTIME) requirements/dev.txt
	$(BIN)/python -m pip install --quiet -c requirements/dev.txt -e '.[dev]' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@# Debian packages the tests use: kcat (a C Kafka client), chromium (the browser tests) and postgresql
	@# (the scale-out tests start a server of their own)
	@missing=""; \
	  command -v kcat >/dev/null 2>&1 || missing="$$missing kcat"; \
	  command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	  { command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || missing="$$missing postgresql"; \
	  if [ -n "$$missing" ]; then SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    if command -v apt-get >/dev/null 2>&1; then \
	      echo "installing Debian packages:$$missing"; \
	      $$SUDO apt-get install -y -qq $$missing >/dev/null 2>&1 || { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; }; \
	    else echo "warning: install$$missing (the Kafka and browser tests need them)"; fi; fi
	touch $@

# The lock files, from pyproject.toml: runtime.txt and image.txt for any platform (the image is Linux, users'
# machines anything), dev.txt for the Linux x86-64 machines that run the tests. dev.txt pins PyPI's torch
# (with its CUDA libraries): `make env` takes the CPU build of the same version from TORCH_INDEX, which the
# pin admits (torch==2.13.0 matches 2.13.0+cpu), and the CUDA pins apply only where they are installed. uv
# keeps the versions already locked unless pyproject.toml rules them out; LOCK_FLAGS adds options
# (--upgrade, --upgrade-package NAME).
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --quiet --python-version 3.11 --annotation-style line \
	--custom-compile-command 'make lock' $(LOCK_FLAGS)

# Needs uv only (not the environments, whose installs the old locks constrain: a changed pyproject.toml could
# conflict with them until this has run).
lock:
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	@[ -x $(BIN)/uv ] || $(BIN)/python -m pip install --quiet 'uv>=0.5'
	$(UV_COMPILE) --universal -o requirements/runtime.txt
	$(UV_COMPILE) --universal --extra scaleout -o requirements/image.txt
	$(UV_COMPILE) --extra dev --python-platform x86_64-manylinux_2_28 -o requirements/dev.txt

# The end-to-end path on embedded defaults and the bundled Azure conversation trace.
demo: $(RUNTIME)
	$(BIN)/servelens demo

# Lint, the type checker, then the whole test suite (the layering contract is tests/test_architecture.py;
# pytest exits non-zero when it collects no tests), on one pytest-xdist worker per core, at most
# PYTEST_WORKERS, a test file to a worker at a time (tests/conftest.py); PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 4
test: $(DEV)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n auto --maxprocesses $(PYTEST_WORKERS) --dist loadfile)

# The Dagster UI over the batch side (asset graph, partitions, checks, schedules) on 127.0.0.1:3000.
dagster: $(RUNTIME)
	$(BIN)/dagster dev -m pipelines.definitions

# The Streamlit dashboard on http://127.0.0.1:8501 over the lake, replay runs and gate reports (docs/dashboard.md).
dashboard: $(RUNTIME)
	$(BIN)/servelens dashboard $(DASHBOARD_ARGS)
