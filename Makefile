# Every target creates .venv and installs what it needs when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gymckpt demo

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# local store against its primitives and peers, then S3 (an embedded moto server) against raw s3fs
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.bench_s3 $(BENCH_S3_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gymckpt tests benchmarks
	$(BIN)/ruff format --check gymckpt tests benchmarks

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
