"""The machines of a run: `strategy.hosts` ("host1:8,host2:8", each host
with its worker slots; a host of 0 slots carries no worker, but the
parameter server's ps tasks when it comes first), or, in a SLURM job of
several nodes, the job's nodes.
Remote processes start over ssh, as horovodrun starts its ranks; in a SLURM
job, every process is a job step (distrepro.slurm)."""

from __future__ import annotations

import os
import shlex
import socket

from distrepro import slurm


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


def from_slurm(strategy, environ=os.environ) -> str | None:
    """strategy.hosts inside a SLURM job of several nodes: the job's nodes in
    its order, strategy.workers_per_node on each (unset: the workers spread
    evenly, as the job's tasks are), the last node taking what is left.
    None outside a SLURM job, or in one of a single node. Too few nodes for
    the workers are the launcher's to refuse (launch.validate_nodes)."""
    nodes = slurm.job_nodes(environ)
    if len(nodes) < 2:
        return None
    n, per_node = strategy.num_workers, strategy.workers_per_node
    if per_node:
        slots = [min(per_node, n - first) for first in range(0, n, per_node)]
    else:
        share, extra = divmod(n, len(nodes))
        slots = [share + (i < extra) for i in range(len(nodes))]
    return ",".join(f"{node}:{k}" for node, k in zip(nodes, slots, strict=False) if k)


def of_run(cfg) -> list[tuple[str, int]] | None:
    """The run's hosts and slots; None when every process runs on this machine."""
    text = cfg.strategy.hosts or from_slurm(cfg.strategy)
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


def command_on(host: str, command: list[str], env: dict[str, str], name: str) -> list[str]:
    """command, with env, on host: in a SLURM job of several nodes a job step
    named name; else directly when local, or over ssh in this directory. A
    pseudo-terminal (-tt) makes the remote process end with the connection,
    when the launcher stops the ssh client."""
    if slurm.in_job_of_several_nodes():
        return slurm.step([(host, 1)], command, name)  # srun passes on the environment
    if is_local(host):
        return command
    exports = [f"{key}={value}" for key, value in env.items()]
    remote = f"cd {shlex.quote(os.getcwd())} && exec env {shlex.join([*exports, *command])}"
    return ["ssh", "-tt", "-o", "LogLevel=ERROR", host, remote]
