"""What the interconnect costs a training: bytes per step on each link and
images/s per strategy, in plain formulas with nothing fitted to the runs
they are compared with.

A step is one global batch: one synchronous update, or one update of each
asynchronous parameter-server worker. Links are full duplex: each direction
carries its own bytes at the link's rate B (bytes/s).

Bytes per step, with N workers, G gradient bytes (trainable parameters x 4,
or x 2 with fp16 all-reduce) and M variable bytes (every parameter, fp32):

  all-reduce (a ring)   each worker sends and receives 2(N-1)/N x G.
  parameter server      each worker receives R x M and sends G (its
                        gradients); the links of the P ps hosts together
                        receive N x G and send N x R x M. R = 2: a worker's
                        update reads each variable from its ps twice, in the
                        forward pass and again in the backward (a layer's
                        gradient with respect to its input needs its
                        weights); TensorFlow does not keep remote reads
                        within a step.

Time per step, with c one worker's compute time per update (forward and
backward of its batch: measured with the same processes on unshaped links,
or its batch / a device's published img/s):

  all-reduce            c + max(0, 2(N-1)/N x G / B - o x 2/3 c)
                        The backward pass is 2/3 of c (twice the forward's
                        work); o is the share of it the all-reduce may
                        overlap: Horovod reduces gradients as the backward
                        produces them (o = 1 at most); TensorFlow's
                        all-reduce after it (o = 0). Where Horovod's
                        timeline of the unshaped runs shows the gradients
                        becoming ready within a time r, o is at most
                        r / (2/3 c). B is the ring's slowest edge: the
                        hosts' link when the workers span hosts, else the
                        link between a host's devices.
  parameter server      max(c + (R x M + G) / B_w, N x max(R x M, G) / (P x B_ps))
                        A worker reads, computes, then sends over its own
                        path to the ps tasks, B_w (its host's link, or within
                        one host its PCIe lanes); the P ps links B_ps carry
                        every worker's traffic.

  img/s = global batch / time per step.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # of a worker's compute: the backward pass does twice the forward's work
PS_READS = 2  # reads of each variable per parameter-server update: forward and backward


@dataclass(frozen=True)
class Links:
    """Bytes/s of each link, each way."""

    hosts: float  # a host's link to the others (its NIC; here the shaped veth)
    devices: float  # between two workers of one host (NVLink, PCIe)
    worker_ps: float  # a worker's own path to the ps tasks
    ps: float  # a ps task's link (its host's link, or the PCIe to the CPU hosting it)


@dataclass(frozen=True)
class Setting:
    workers: int
    workers_per_host: int
    num_ps: int
    global_batch: int
    compute_s: float  # one worker's compute time per update


def gradient_bytes(trainable_parameters: int, fp16_allreduce: bool) -> float:
    return trainable_parameters * (2 if fp16_allreduce else 4)


def variable_bytes(parameters: int) -> float:
    return parameters * 4  # fp32 master variables, also under mixed precision


def ring_bytes(workers: int, gradients: float) -> float:
    """What each worker sends (and receives) per all-reduce of a ring."""
    return 2 * (workers - 1) / workers * gradients


def expected_bytes(
    exchange: str, workers: int, num_ps: int, gradients: float, variables: float
) -> dict[str, dict[str, float]]:
    """Bytes per step on a worker's link and on a ps task's link, each way."""
    if exchange == "all-reduce":
        each = ring_bytes(workers, gradients)
        return {"worker": {"sent": each, "received": each}}
    read = PS_READS * variables
    return {
        "worker": {"sent": gradients, "received": read},
        "ps": {"sent": workers * read / num_ps, "received": workers * gradients / num_ps},
    }


def step_time(
    exchange: str,
    overlap: float,
    setting: Setting,
    links: Links,
    gradients: float,
    variables: float,
) -> float:
    """Seconds per step (see the module's formulas)."""
    n, c = setting.workers, setting.compute_s
    if exchange == "all-reduce":
        spans_hosts = n > setting.workers_per_host
        edge = links.hosts if spans_hosts else links.devices
        communication = ring_bytes(n, gradients) / edge
        return c + max(0.0, communication - overlap * BACKWARD_SHARE * c)
    read = PS_READS * variables
    own = c + (read + gradients) / links.worker_ps
    ps_links = n * max(read, gradients) / (setting.num_ps * links.ps)
    return max(own, ps_links)


def overlap(most: float, ready_within_s: float | None, compute_s: float) -> float:
    """o: the strategy's `most`, bounded by how long the gradients take to
    become ready (when measured) against the backward pass."""
    if ready_within_s is None:
        return most
    return min(most, ready_within_s / (BACKWARD_SHARE * compute_s))


def gbit(value: float) -> float:
    """Gbit/s -> bytes/s."""
    return value * 1e9 / 8
