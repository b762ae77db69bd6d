"""The setup's variant detection and GPU build environment, with stand-in
`nvidia-smi` and `nvcc` scripts (no GPU or CUDA 12 toolkit is needed)."""

from __future__ import annotations

import os
import stat
import subprocess
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

V100 = "GPU 0: Tesla V100-SXM2-16GB (UUID: GPU-0f0e0d0c-0b0a-0908-0706-050403020100)"


def stand_in(path: Path, output: str, status: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\ncat <<'OUT'\n{output}\nOUT\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def cuda_toolkit(root: Path, release: str) -> Path:
    stand_in(
        root / "bin" / "nvcc",
        "nvcc: NVIDIA (R) Cuda compiler driver\n"
        f"Cuda compilation tools, release {release}, V{release}.99\n",
    )
    return root


PRINT_BUILD_ENV = ("bash", "scripts/setup.sh", "--print-build-env")


def setup_sh(tmp_path, command=PRINT_BUILD_ENV, gpus: str | None = V100, cuda=None, **env):
    """Run command with a stand-in nvidia-smi first on PATH and CUDA_HOME at `cuda`."""
    bin_dir = tmp_path / "bin"
    if gpus is None:
        stand_in(bin_dir / "nvidia-smi", "No devices were found", status=6)
    else:
        stand_in(bin_dir / "nvidia-smi", gpus)
    environ = {k: v for k, v in os.environ.items() if k != "GPU"}
    environ.update(PATH=f"{bin_dir}:{os.environ['PATH']}", CUDA_HOME=str(cuda or tmp_path), **env)
    return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True)


def build_env(out: str) -> dict[str, str]:
    return dict(word.split("=", 1) for line in out.splitlines() for word in line.split())


def test_a_listed_gpu_and_cuda_12_give_the_nccl_build(tmp_path):
    cuda = cuda_toolkit(tmp_path / "cuda-12.4", "12.4")
    result = setup_sh(tmp_path, cuda=cuda)
    assert result.returncode == 0, result.stderr
    env = build_env(result.stdout)
    nccl = REPO / ".venv/lib" / f"python{sysconfig.get_python_version()}" / "site-packages"
    nccl = nccl / "nvidia/nccl"
    assert env["variant"] == "cuda12.4-nccl2.21.5"
    assert env["lock"] == "requirements-gpu.lock"
    assert Path(env["wheel"]).name == "horovod-0.28.1-tf2.18.1-cuda12.4-nccl2.21.5-mpi-gloo"
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_CUDA_HOME"] == str(cuda)
    assert env["HOROVOD_NCCL_INCLUDE"] == str(nccl / "include")
    assert env["HOROVOD_NCCL_LIB"] == str(nccl / "lib")
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"].split(",")[0] == "70"  # the V100
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"].split(",")[-1] == "90"
    assert env["HOROVOD_WITH_MPI"] == env["HOROVOD_WITH_GLOO"] == "1"


@pytest.mark.parametrize("gpus, forced", [(None, None), (V100, "0")])
def test_no_gpu_or_gpu_0_gives_the_cpu_build(tmp_path, gpus, forced):
    cuda = cuda_toolkit(tmp_path / "cuda-12.4", "12.4")
    extra = {"GPU": forced} if forced else {}
    result = setup_sh(tmp_path, gpus=gpus, cuda=cuda, **extra)
    assert result.returncode == 0, result.stderr
    env = build_env(result.stdout)
    assert env["variant"] == "cpu" and env["lock"] == "requirements.lock"
    assert env["HOROVOD_WITH_MPI"] == "1" and "HOROVOD_GPU_OPERATIONS" not in env


@pytest.mark.parametrize("release", ["11.8", "13.0", None])
def test_a_gpu_build_without_cuda_12_is_refused_clearly(tmp_path, release):
    cuda = cuda_toolkit(tmp_path / "cuda", release) if release else None
    result = setup_sh(tmp_path, cuda=cuda)
    assert result.returncode == 1
    assert "CUDA 12" in result.stderr and "GPU=0" in result.stderr
    assert (f"is CUDA {release}" if release else "no nvcc at") in result.stderr
    assert result.stdout == ""


def test_gpu_1_make_setup_stops_before_touching_the_cpu_environment(tmp_path):
    stamps = [REPO / ".venv/.lock-hash", REPO / ".venv/.horovod-wheel"]
    before = [p.read_text() if p.exists() else None for p in stamps]
    cuda = cuda_toolkit(tmp_path / "cuda-13.0", "13.0")
    result = setup_sh(tmp_path, ["make", "setup"], cuda=cuda, GPU="1")
    assert result.returncode != 0
    assert "is CUDA 13.0" in result.stderr and "GPU=0 builds the CPU variant" in result.stderr
    assert "installing" not in result.stdout and "building" not in result.stdout
    assert [p.read_text() if p.exists() else None for p in stamps] == before


def test_gpu_check_says_there_is_no_gpu_and_stops(tmp_path):
    result = setup_sh(tmp_path, ["make", "gpu-check"], gpus=None)
    assert result.returncode != 0
    assert "no GPU" in result.stderr and "setup" not in result.stdout
