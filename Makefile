# Every target creates .venv and installs what it needs when missing: `make demo` only gymckpt and
# its base dependencies, `make test`, `bench` and `lint` the dev extras too.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# what an install builds from: an edited setup.py or C accelerator is reinstalled (rebuilt) by the next target
INSTALL_INPUTS := pyproject.toml setup.py gymckpt/store/_exact.c

.PHONY: demo test bench bench-scale bench-ray lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(INSTALL_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

# the dev extras include the base dependencies: a dev install serves `make demo` too
$(DEV_STAMP): $(INSTALL_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(DEV_STAMP) $(STAMP)

demo: $(STAMP)
	$(BIN)/gymckpt demo

# two test processes, each taking whole files (a module's server stack stays in one process);
# PYTEST_ARGS="-n 0" runs them in this process, one after another
PYTEST_ARGS ?= -n 2 --dist loadfile
# tests/sharedfs needs MooseFS and s3fs from Debian: installed here when missing (as root); otherwise
# those tests are skipped, saying what to install (and fail where GYMCKPT_REQUIRE_SHAREDFS is set, as in CI)
# tests/integrations run NeMo Gym's servers under Python 3.12: .ci/nemo-gym-venv builds .venv-nemo (once) where
# a Python 3.12 exists; otherwise those tests are skipped, saying what to install (and fail where
# GYMCKPT_REQUIRE_NEMO_GYM is set, as in CI)
test: $(DEV_STAMP)
	@.ci/sharedfs-deps || echo "make test: the shared-filesystem tests will be skipped (see above)"
	@.ci/nemo-gym-venv || echo "make test: the NeMo Gym integration tests will be skipped (see above)"
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# local store against its primitives and peers, then S3 (an embedded moto server) against raw s3fs
bench: $(DEV_STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.bench_s3 $(BENCH_S3_ARGS)
	$(BIN)/python -m benchmarks.bench_reference $(BENCH_REFERENCE_ARGS)
	$(BIN)/python -m benchmarks.bench_workers $(BENCH_WORKERS_ARGS)
	$(BIN)/python -m benchmarks.bench_telemetry $(BENCH_TELEMETRY_ARGS)

# three scenarios, each checkpointed, SIGKILLed, restored and compared: (a) the reference stack at 16,000 rollouts,
# one and two workers per server; (b) 1,000 sandbox sessions of 350 KB; (c) (a) checkpointing to S3 (moto).
# Short runs: BENCH_SCALE_ARGS="--scenario b --sessions 200", or "--scenario a --rollouts 2000 --workers 1"
bench-scale: $(DEV_STAMP)
	$(BIN)/python -m benchmarks.bench_scale $(BENCH_SCALE_ARGS)

# the Ray demo's scenario (three local Ray nodes, one SIGKILLed) against the one-machine stack, side by side, at
# 2,000 rollouts; needs root, iproute2 and util-linux (the dev extras bring ray and moto). Short: BENCH_RAY_ARGS="--rollouts 500"
bench-ray: $(DEV_STAMP)
	$(BIN)/python -m benchmarks.bench_ray $(BENCH_RAY_ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check gymckpt tests benchmarks examples
	$(BIN)/ruff format --check gymckpt tests benchmarks examples

clean:
	rm -rf $(VENV) .venv-nemo checkpoints .pytest_cache
