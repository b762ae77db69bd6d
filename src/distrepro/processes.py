"""Starting, stopping and restarting the processes of a training run.

Each process is started in a session of its own and stopped with its whole
process group, by pid, when training ends, fails or is interrupted. Should
the launcher die without stopping them (SIGKILL, the OOM killer), the kernel
kills each of them too (its parent-death signal); what they started in turn
ends with them: horovodrun's ranks when horovodrun goes, a remote task when
its ssh client does."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from distrepro.atomic import write_json_atomically
from distrepro.devices import host_gpus
from distrepro.handoff import TERMINAL


class TrainingFailed(RuntimeError):
    """The run failed more often than train.max_restarts allows."""


class Restarts:
    """The restarts of one launch, at most train.max_restarts, each printed and
    recorded with the run's earlier ones (run_dir/restarts.json and the MLflow
    run's metric `restarts`)."""

    def __init__(self, limit: int, run_dir: Path):
        self.limit, self.used, self.path = limit, 0, run_dir / "restarts.json"
        self.causes: list[str] = json.loads(self.path.read_text()) if self.path.exists() else []

    def record(self, cause: str) -> None:
        if self.used >= self.limit:
            raise TrainingFailed(
                f"{cause}; giving up: train.max_restarts={self.limit} restarts already used"
            )
        self.used += 1
        self.causes.append(cause)
        write_json_atomically(self.path, self.causes)
        print(f"launch: {cause}; restart {self.used} of at most {self.limit}", flush=True)
        from distrepro.tracking import log_restarts

        log_restarts(self.path.parent, self.causes)


def process_env(cfg: DictConfig) -> dict[str, str]:
    """What every training process of cfg gets in its environment."""
    env = {"GRPC_FAIL_FAST": "use_caller"}
    # The code and the MLflow store the launcher uses, also for processes it
    # starts over ssh (which pass on only what is named).
    env |= {k: os.environ[k] for k in ("PYTHONPATH", "MLFLOW_TRACKING_URI") if k in os.environ}
    if sys.stdout.isatty():
        env[TERMINAL] = os.ttyname(sys.stdout.fileno())
    if cfg.train.profile:
        env["HOROVOD_TIMELINE"] = "DYNAMIC"  # hvd.start_timeline() records the window
    if cfg.train.xla:
        # XLA auto-clustering of the training step, in every process that runs it.
        env["TF_XLA_FLAGS"] = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit"
    if cfg.strategy.controller == "mpi" and os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if not cfg.strategy.gpus_per_worker and host_gpus():
        env["CUDA_VISIBLE_DEVICES"] = ""  # asked for no GPU: TF would take them all
    return env


PR_SET_PDEATHSIG = 1  # prctl(2)
LIBC = ctypes.CDLL(None, use_errno=True)


def end_with_parent(signum: int) -> None:
    """Have the kernel send this process signum when its parent ends (the
    thread of its parent that started it, precisely)."""
    LIBC.prctl(PR_SET_PDEATHSIG, signum)


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start cmd in a session of its own, to die with this process. Call it
    from the main thread: the signal follows the thread that started it."""
    launcher = os.getpid()

    def die_with_launcher() -> None:  # in the child, before exec
        end_with_parent(signal.SIGKILL)
        if os.getppid() != launcher:  # it died before prctl
            os._exit(1)

    env = {**os.environ, **(env or {})}
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_launcher)


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Signal the process group the launcher started proc in (its children too)."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass  # the whole group has already exited


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, then SIGKILL what is left after 5 s."""
    for proc in processes:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in processes:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
