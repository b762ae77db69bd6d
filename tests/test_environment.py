"""The environment: registry-only locks, the conda spec agrees with the lock,
Horovod built with TF + MPI + Gloo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
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


REGISTRY_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+(\s*;[^@]*)?$")
CONDA_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(=[0-9][0-9.*]*)?$")


def not_registry_pins(path: Path) -> list[str]:
    """`file:line: text` of every requirement that is not a plain `name==version`."""
    bad = []
    if path.suffix == ".yml":
        spec = yaml.safe_load(path.read_text())
        items = [(d, CONDA_PIN) for d in spec["dependencies"] if isinstance(d, str)]
        items += [
            (p, REGISTRY_PIN) for d in spec["dependencies"] if isinstance(d, dict) for p in d["pip"]
        ]
        lines = path.read_text().splitlines()
        for item, pattern in items:
            if not pattern.match(item):
                number = next(i for i, line in enumerate(lines, 1) if item in line)
                bad.append(f"{path.name}:{number}: {item}")
        return bad
    for number, line in enumerate(path.read_text().splitlines(), 1):
        requirement = line.split("#")[0].strip()
        if requirement and not REGISTRY_PIN.match(requirement):
            bad.append(f"{path.name}:{number}: {requirement}")
    return bad


@pytest.mark.parametrize("name", ["requirements.lock", "requirements-gpu.lock", "environment.yml"])
def test_locks_hold_registry_pins_only(name):
    assert not_registry_pins(REPO / name) == []


@pytest.mark.parametrize(
    "line",
    [
        "horovod @ file:///root/.cache/horovod-0.28.1-cp311-linux_x86_64.whl",
        "https://example.org/pkg-1.0.tar.gz",
        "-e .",
        "./wheels/horovod-0.28.1.whl",
        "tensorflow>=2.18",
    ],
)
def test_the_lock_check_names_a_line_that_is_no_registry_pin(tmp_path, line):
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"absl-py==2.5.1\n    # via keras\n{line}\n")
    assert not_registry_pins(lock) == [f"requirements.lock:3: {line}"]


def test_horovod_is_built_with_tensorflow_mpi_and_gloo():
    horovodrun = Path(sys.executable).parent / "horovodrun"
    out = subprocess.run([horovodrun, "--check-build"], capture_output=True, text=True, check=True)
    assert re.search(r"\[X\] TensorFlow", out.stdout)
    controllers = re.search(r"Available Controllers:(.*?)\n\n", out.stdout, re.S)[1]
    assert "[X] MPI" in controllers and "[X] Gloo" in controllers


def test_tf_keras_is_the_keras_in_use():
    import tensorflow as tf

    import distrepro  # noqa: F401

    assert tf.keras.__name__.startswith("tf_keras")


def test_lint_is_clean():
    ruff = Path(sys.executable).parent / "ruff"
    subprocess.run([ruff, "check", "src", "tests", "benchmarks"], cwd=REPO, check=True)
    subprocess.run([ruff, "format", "--check", "src", "tests", "benchmarks"], cwd=REPO, check=True)
