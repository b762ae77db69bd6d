"""The setup's variant detection and GPU build environment, with stand-in
`nvidia-smi` and `nvcc` scripts (no GPU or CUDA 12 toolkit is needed); its
Debian packages as a user who is not root."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
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


# A user that is not root: an unprivileged user namespace (uid 1000, no capabilities).
AS_USER = (
    shutil.which("unshare") or "unshare",
    "--user",
    "--map-user=1000",
    "--map-group=1000",
    "--",
)
MAIN_PACKAGES = "cmake g++ make openmpi-bin libopenmpi-dev"
TEST_PACKAGES = ("chromium", "openssh-server", "munge", "slurmctld", "slurmd", "slurm-client")


def user_namespaces() -> bool:
    return subprocess.run([*AS_USER, "true"], capture_output=True).returncode == 0


needs_user_namespace = pytest.mark.skipif(
    not user_namespaces(), reason="needs unprivileged user namespaces (unshare --user)"
)


def bare_machine(tmp_path: Path, sudo: bool = False) -> dict[str, str]:
    """The environment of a user on a machine with Python but no build tools
    or Open MPI (a PATH of a few tools), and a stand-in sudo that records its
    arguments in tmp_path/sudo-args when asked for."""
    bin_dir = tmp_path / "bare-bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "realpath", "sed", "cat", "id", "sha256sum", "cut"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3.11").symlink_to(Path(sys.executable).resolve())
    if sudo:
        (bin_dir / "sudo").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "sudo-args"}\n')
        (bin_dir / "sudo").chmod(0o755)
    return {**os.environ, "PATH": str(bin_dir), "PYTHON": "python3.11"}


@needs_user_namespace
def test_setup_as_a_user_with_the_packages_present_succeeds():
    # The wheel cache the suite's own setup used (CI's is a fresh folder).
    wheel_cache = Path((REPO / ".venv/.horovod-wheel").read_text().strip()).parent
    env = {**os.environ, "DISTREPRO_WHEEL_CACHE": str(wheel_cache)}
    result = subprocess.run(
        [*AS_USER, "make", "setup"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installing" not in result.stdout and "building" not in result.stdout


@needs_user_namespace
def test_a_user_without_sudo_is_given_the_install_line_and_nothing_is_created(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    shutil.copy(REPO / "requirements.lock", repo)
    result = subprocess.run(
        [*AS_USER, str(shutil.which("bash")), "scripts/setup.sh"],
        cwd=repo,
        env=bare_machine(tmp_path),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert f"as root, run: apt-get install --no-install-recommends {MAIN_PACKAGES}" in (
        result.stderr
    )
    assert not any(package in result.stderr.split() for package in TEST_PACKAGES)
    assert sorted(p.name for p in repo.iterdir()) == ["requirements.lock", "scripts"]


@needs_user_namespace
def test_a_user_with_sudo_is_told_before_sudo_installs(tmp_path):
    result = subprocess.run(
        [*AS_USER, str(shutil.which("bash")), "scripts/packages.sh", "main"],
        cwd=REPO,
        env=bare_machine(tmp_path, sudo=True),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert f"with sudo, which may ask for your password: {MAIN_PACKAGES}" in result.stdout
    args = (tmp_path / "sudo-args").read_text().split()
    assert args[:2] == ["bash", str(REPO / "scripts/packages.sh")]
    assert args[2:] == ["install", *MAIN_PACKAGES.split()]
