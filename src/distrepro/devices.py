"""Which GPUs each training process may use: placement belongs to the strategy.

Horovod: every rank uses the one GPU of its local rank (chosen inside the
rank, see `training.runtime.use_gpu`). Parameter server and TensorFlow's
all-reduce: the i-th worker task of a host gets its `strategy.gpus_per_worker`
GPUs through CUDA_VISIBLE_DEVICES; ps tasks and the coordinator get none. On a
machine without GPUs nothing is set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping


def host_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES when a scheduler
    set it, else every GPU that `nvidia-smi -L` lists."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [
            g for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() not in ("", "-1")
        ]
    nvidia_smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if nvidia_smi is None:
        return []
    listing = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True).stdout
    return re.findall(r"^GPU (\d+):", listing, re.M)


def assign_gpus(num_workers: int, gpus_per_worker: int, gpus: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each worker: consecutive groups of gpus_per_worker."""
    needed = num_workers * gpus_per_worker
    if needed > len(gpus):
        raise ValueError(
            f"strategy.num_workers={num_workers} x strategy.gpus_per_worker={gpus_per_worker} "
            f"needs {needed} GPUs, but this machine has {len(gpus)}"
        )
    per = gpus_per_worker
    return [",".join(gpus[i * per : (i + 1) * per]) for i in range(num_workers)]


def devices_of_tasks(
    placed: dict[str, str], gpus_per_worker: int, gpus: list[str]
) -> dict[str, dict[str, str]]:
    """Environment of each task ("worker:0", "ps:0", "coordinator") given the
    host of each (placed): worker i takes its GPUs by its index on its host,
    every host taken to be like this one; {} without GPUs."""
    if not gpus:
        return {}
    devices = {name: {"CUDA_VISIBLE_DEVICES": ""} for name in [*placed, "coordinator"]}
    for host in set(placed.values()):
        workers = [name for name, on in placed.items() if on == host and name.startswith("worker")]
        groups = assign_gpus(len(workers), gpus_per_worker, gpus)
        for name, group in zip(workers, groups, strict=True):
            devices[name] = {"CUDA_VISIBLE_DEVICES": group}
    return devices
