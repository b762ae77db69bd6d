"""The machines of a run: `strategy.hosts` ("host1:8,host2:8", each host
with its worker slots; a host of 0 slots carries no worker, but the
parameter server's ps tasks when it comes first), or, in a SLURM job of
several nodes, the job's nodes.
Remote processes start over ssh, as horovodrun starts its ranks."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess


class HostsError(ValueError):
    """strategy.hosts cannot be read."""


def parse(text: str) -> list[tuple[str, int]]:
    """[(host, slots)] of "host1:8,host2:8"; slots may be 0."""
    hosts = []
    for entry in text.split(","):
        host, _, slots = entry.strip().partition(":")
        if not host or not slots.isdigit():
            raise HostsError(f"strategy.hosts={text!r}: {entry!r} is not HOST:SLOTS")
        hosts.append((host, int(slots)))
    return hosts


def slurm(num_workers: int, environ=os.environ) -> str | None:
    """strategy.hosts inside a SLURM job of several nodes: the job's nodes
    (SLURM_JOB_NODELIST, expanded by `scontrol`; a job step that Snakemake's
    jobstep executor starts with `srun -n1` keeps it), the workers spread
    over them evenly, as the job's tasks are."""
    listed = environ.get("SLURM_JOB_NODELIST", "")
    if not any(sign in listed for sign in ",["):  # not in a job, or on one node
        return None
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", listed],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if len(nodes) < 2:
        return None
    share, extra = divmod(num_workers, len(nodes))
    slots = [share + (i < extra) for i in range(len(nodes))]
    return ",".join(f"{node}:{n}" for node, n in zip(nodes, slots, strict=True) if n)


def of_run(cfg) -> list[tuple[str, int]] | None:
    """The run's hosts and slots; None when every process runs on this machine."""
    text = cfg.strategy.hosts or slurm(cfg.strategy.num_workers)
    return parse(text) if text else None


def is_local(host: str) -> bool:
    """Whether host is this machine: its address can be bound here."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket() as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


def command_on(host: str, command: list[str], env: dict[str, str]) -> list[str]:
    """command, with env, on host: directly when local, else over ssh in this
    directory. A pseudo-terminal (-tt) makes the remote process end with the
    connection, when the launcher stops the ssh client."""
    if is_local(host):
        return command
    exports = [f"{key}={value}" for key, value in env.items()]
    remote = f"cd {shlex.quote(os.getcwd())} && exec env {shlex.join([*exports, *command])}"
    return ["ssh", "-tt", "-o", "LogLevel=ERROR", host, remote]
