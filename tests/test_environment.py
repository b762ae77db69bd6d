"""The environment: conda spec agrees with the lock; Horovod built with TF + Gloo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO


def pins(lines) -> dict[str, str]:
    found = (re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip()) for line in lines)
    return {m[1].lower().replace("_", "-"): m[2] for m in found if m}


def test_environment_yml_pins_are_the_locks():
    lock = pins((REPO / "requirements.lock").read_text().splitlines())
    spec = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    conda_pins = pins(pip_section)
    assert len(conda_pins) >= 15
    assert {name: lock.get(name) for name in conda_pins} == conda_pins
    top_level = [
        line.split("#")[0].split("<")[0].strip()
        for line in (REPO / "requirements.in").read_text().splitlines()
    ]
    names = {n.lower().replace("_", "-").split("==")[0] for n in top_level if n}
    assert names <= set(conda_pins) | {"tf-keras"}


def test_horovod_is_built_with_tensorflow_and_gloo():
    horovodrun = Path(sys.executable).parent / "horovodrun"
    out = subprocess.run([horovodrun, "--check-build"], capture_output=True, text=True, check=True)
    assert re.search(r"\[X\] TensorFlow", out.stdout)
    assert re.search(r"Available Controllers:.*?\[X\] Gloo", out.stdout, re.S)


def test_tf_keras_is_the_keras_in_use():
    import tensorflow as tf

    import distrepro  # noqa: F401

    assert tf.keras.__name__.startswith("tf_keras")


def test_lint_is_clean():
    ruff = Path(sys.executable).parent / "ruff"
    subprocess.run([ruff, "check", "src", "tests", "benchmarks"], cwd=REPO, check=True)
    subprocess.run([ruff, "format", "--check", "src", "tests", "benchmarks"], cwd=REPO, check=True)
