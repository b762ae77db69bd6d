# `make reproduce` sets everything up and runs the main job; `make test` the tests.
export PATH := $(CURDIR)/.venv/bin:$(PATH)
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: setup reproduce test ui

setup:
	bash scripts/setup.sh

reproduce: setup
	snakemake --cores all reproduce

test: setup
	pytest

ui:
	mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(CURDIR)/mlflow.db
