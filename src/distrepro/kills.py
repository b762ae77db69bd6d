"""Lost workers, for the churn experiment (distrepro.network): a worker's
training processes on one of the project's hosts killed with SIGKILL at
random times, exponentially apart with a mean interval, under a seed of
their own, at most a number of times; each kill recorded."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path


def training_pids(namespace: str) -> list[int]:
    """The project's training processes in a host's network namespace: not its
    sshd and ssh sessions, nor a parameter server's ps task beside the worker
    (the experiment loses workers, not the model's variables)."""
    listing = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    pids = []
    for pid in map(int, listing.stdout.split()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        training = b"-m" in command and any(arg.startswith(b"distrepro.") for arg in command)
        ps_task = b"task" in command and command[command.index(b"task") :][:2] == [b"task", b"ps"]
        if training and not ps_task:
            pids.append(pid)
    return pids


class Kills:
    """SIGKILL of the training processes of `host` (network namespace
    `namespace`) in a thread, from `started` on; `records` holds each kill:
    seconds since the launch, the host, the processes."""

    def __init__(self, namespace: str, host: str, interval_s: float, seed: str, most: int):
        self.namespace, self.host, self.most = namespace, host, most
        self.interval_s, self.random = interval_s, random.Random(seed)
        self.records: list[dict] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.kill, daemon=True)

    def kill(self) -> None:
        while len(self.records) < self.most:
            if self.done.wait(self.random.expovariate(1 / self.interval_s)):
                return
            pids = training_pids(self.namespace)
            if not pids:
                continue  # between attempts: nothing of the worker's to kill now
            commands = []
            for pid in pids:
                try:
                    commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "))
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
            at = time.time() - self.started
            self.records.append(
                {
                    "at_s": round(at, 2),
                    "host": self.host,
                    "pids": pids,
                    "processes": [c.decode().strip() for c in commands],
                }
            )
            print(f"churn: killed {self.host}'s {pids} at {at:.1f} s", flush=True)

    def __enter__(self) -> Kills:
        self.started = time.time()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
