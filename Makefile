# Multi-Head Attention, from one head to the GPU: build, check and run the book.
# Every target creates .venv on first use (Python 3.11+), installs the pinned
# requirements and the `mha` package (editable), then does its work.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
JB     := $(BIN)/jupyter-book
# Fixed thread counts keep training and timings comparable between runs.
export OMP_NUM_THREADS ?= 2
export MKL_NUM_THREADS ?= 2
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: help venv book test lint unit nbval html-checks lab refresh bench clean

help:
	@echo "make book     build the HTML book (executes every chapter, fails on any warning)"
	@echo "make test     every check: ruff, pytest, nbval on the stored notebooks, the book build, built-HTML checks"
	@echo "make lab      JupyterLab on chapters/ with mha importable"
	@echo "make refresh  re-execute every notebook in place so its stored outputs are current"
	@echo "make bench    python -m mha.bench with its defaults on this machine's CPU"
	@echo "make clean    remove _build and caches (keeps .venv)"

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

book: $(STAMP)
	$(JB) build --warningiserror --keep-going .
	@echo
	@echo "The book is built: $(CURDIR)/_build/html/index.html"

lint: $(STAMP)
	$(BIN)/ruff format --check
	$(BIN)/ruff check
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml

unit: $(STAMP)
	$(BIN)/python -m pytest tests --ignore=tests/book

nbval: $(STAMP)
	$(BIN)/python -m pytest --nbval --nbval-current-env chapters

html-checks: $(STAMP)
	$(BIN)/python -m pytest tests/book

test: lint unit nbval book html-checks
	@echo "make test: every check passed"

lab: $(STAMP)
	$(BIN)/jupyter lab chapters

refresh: $(STAMP)
	for nb in chapters/*.ipynb; do \
	  echo "executing $$nb"; \
	  $(BIN)/jupyter execute --inplace --timeout=900 "$$nb" || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python -m mha.bench --device cpu

clean:
	rm -rf _build .pytest_cache .hypothesis
