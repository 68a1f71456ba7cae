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

.PHONY: help venv book book-stored test lint unit nbval nbval-other-isa html-checks lab refresh bench gpu-check clean

help:
	@echo "make book     build the HTML book (executes every chapter, fails on any warning)"
	@echo "make test     every check: ruff, pytest, nbval on the stored notebooks, the book built from them, built-HTML checks"
	@echo "make nbval-other-isa  nbval again under another instruction set than this CPU's (outputs hold on any CPU)"
	@echo "make lab      JupyterLab on the book (chapters/ first, appendix/) with mha importable"
	@echo "make refresh  re-execute every notebook in place so its stored outputs are current"
	@echo "make bench    python -m mha.bench with its defaults on this machine's CPU"
	@echo "make gpu-check  on a CUDA GPU, with that machine's own python3 (no venv): race grid, cuda tests, timings"
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

# `make test` builds the book from the stored outputs that nbval has just
# compared with a fresh run of every notebook, so each notebook executes once
# there; `make book` executes them itself (cached in _build/.jupyter_cache).
STORED_CONFIG := .config-stored-outputs.yml
book-stored: $(STAMP)
	sed 's/^\(  *execute_notebooks:\).*/\1 "off"/' _config.yml > $(STORED_CONFIG)
	grep -q 'execute_notebooks: "off"' $(STORED_CONFIG)
	$(JB) build --config $(STORED_CONFIG) --warningiserror --keep-going .
	rm -f $(STORED_CONFIG)

lint: $(STAMP)
	$(BIN)/ruff format --check
	$(BIN)/ruff check
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml

# The unit tests and nbval in TEST_WORKERS processes (pytest-xdist; nbval's
# cells of one notebook stay together, in order): about twice as fast on two
# cores; TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
unit: $(STAMP)
	$(BIN)/python -m pytest tests --ignore=tests/book -n $(TEST_WORKERS)

nbval: $(STAMP)
	$(BIN)/python -m pytest --nbval --nbval-current-env chapters appendix \
		-n $(TEST_WORKERS) --dist loadscope

# The stored outputs hold on any CPU: nbval again, with torch and NumPy held to an instruction
# set other than this machine's own (AVX2 on an AVX-512 CPU, the portable default otherwise) and
# a compile cache of its own. CI runs it after `make test`.
nbval-other-isa: $(STAMP)
	$(BIN)/python tests/nbval_other_isa.py chapters appendix

html-checks: $(STAMP)
	$(BIN)/python -m pytest tests/book

test: lint unit nbval book-stored html-checks
	@echo "make test: every check passed"

# JupyterLab listens on the loopback interface unless LAB_IP says otherwise;
# as root (a container), it needs --allow-root to start at all.
LAB_IP   ?= 127.0.0.1
LAB_ARGS ?=
lab: $(STAMP)
	@# the stored outputs are the book's own: trusted, their HTML (the head
	@# view) is shown with its styles
	$(BIN)/jupyter trust chapters/*.ipynb appendix/*.ipynb
	@# served from the book's root, so that appendix/ is reachable too; the
	@# file browser opens on chapters/
	@# _ext/lab_config.py: JupyterLab shows the numbers, citations and
	@# cross-references the book shows, and folds each solution (lab_view.py)
	$(BIN)/jupyter lab --ip=$(LAB_IP) $$([ "$$(id -u)" = 0 ] && echo --allow-root) \
	  --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/chapters \
	  --config=$(CURDIR)/_ext/lab_config.py $(LAB_ARGS)

refresh: $(STAMP)
	for nb in chapters/*.ipynb appendix/*.ipynb; do \
	  echo "executing $$nb"; \
	  $(BIN)/jupyter execute --inplace --timeout=900 "$$nb" || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python -m mha.bench --device cpu

# On a machine with a CUDA GPU, with its own Python (torch >= 2.11, triton >= 3.6,
# transformers >= 5.17) and nothing installed: no venv. Writes benchmarks/gpu_<device>_<date>.json.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m mha.bench.gpu $(GPU_CHECK_ARGS)

clean:
	rm -rf _build .pytest_cache .hypothesis
