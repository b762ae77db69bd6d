# `make reproduce` sets everything up and runs the main job; `make test` the tests.
export PATH := $(CURDIR)/.venv/bin:$(PATH)
export TF_CPP_MIN_LOG_LEVEL := 2
# Registry pins only, for Linux x86_64 and Python 3.11 whatever machine compiles them.
UV_COMPILE := uv pip compile --quiet --python-version 3.11 --python-platform x86_64-unknown-linux-gnu

.PHONY: setup test-setup reproduce test ui lock gpu-check

setup:
	bash scripts/setup.sh

# What only the tests need (browser, ssh, munge, SLURM): never installed by `reproduce`.
test-setup: setup
	bash scripts/packages.sh test

reproduce: setup
	snakemake --cores all reproduce

test: test-setup
	pytest

ui:
	@echo "runs table: $$(python -m distrepro.tracking url distrepro http://127.0.0.1:5000)"
	mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(CURDIR)/mlflow.db

# After editing requirements*.in (needs uv: `make setup` installs it in .venv).
lock:
	$(UV_COMPILE) requirements.in -o requirements.lock
	$(UV_COMPILE) requirements-gpu.in -c requirements.lock -o requirements-gpu.lock

# On a GPU machine: builds the GPU variant, then both strategies briefly on all GPUs.
gpu-check:
	@nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || \
	  { echo "gpu-check: this machine has no GPU (nvidia-smi lists none); stopping" >&2; exit 1; }
	GPU=1 bash scripts/setup.sh
	python benchmarks/gpu_check.py
