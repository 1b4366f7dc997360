# dpprobe: `make demo` and `make test` set up a fresh machine (a .venv in this folder) and run.
# The venv is (re)installed only when pyproject.toml changed; code is installed editable.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test lint docs bench bench-sweep bench-tune bench-extract bench-audit bench-predict bench-export bench-load \
	data clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# Fashion-MNIST from Debian (optional: the demo falls back to scikit-learn digits without it).
data:
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
	  echo "Fashion-MNIST present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) \
	  && echo "installed Fashion-MNIST" || echo "could not install dataset-fashion-mnist; using digits"; \
	else \
	  echo "Fashion-MNIST not installed (sudo apt-get install dataset-fashion-mnist); the demo uses digits"; \
	fi

demo: install data
	$(BIN)/dpprobe demo

# One pytest worker per core (at most 4: each holds its own JAX and torch); `pytest -q` alone
# runs the same tests in one process. --dist worksteal: a worker that runs out of tests takes
# half of another's queue, so the suite ends when the last long test does, not when the worker
# that happened to be handed several of them is done.
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

lint: install
	$(BIN)/ruff check .

# The docs site (mkdocs.yml, docs/): built strictly, so a broken link or reference fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python benchmarks/probe_step.py

bench-sweep: install
	$(BIN)/python benchmarks/probe_sweep.py

bench-tune: install data
	$(BIN)/python benchmarks/linear_scaling.py

bench-extract: install
	$(BIN)/python benchmarks/extract.py

bench-audit: install
	$(BIN)/python benchmarks/audit.py

bench-predict: install
	$(BIN)/python benchmarks/predict.py

bench-export: install
	$(BIN)/python benchmarks/export.py

bench-load: install
	$(BIN)/python benchmarks/probe_load.py

clean:
	rm -rf runs .pytest_cache .ruff_cache .cache
