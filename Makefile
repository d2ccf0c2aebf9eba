# The two set-up commands of the README. Each creates the environment from the project's own files
# (pyproject.toml) on first use, so a fresh clone needs nothing but Python >= 3.11 and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test env

env: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "servelens needs Python >= 3.11: run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The end-to-end path on embedded defaults and the bundled Azure conversation trace.
demo: $(STAMP)
	$(BIN)/servelens demo

# The whole test suite (pytest exits non-zero when it collects no tests).
test: $(STAMP)
	$(BIN)/python -m pytest
