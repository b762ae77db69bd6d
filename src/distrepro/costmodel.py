"""What the interconnect costs a training: bytes per step on each link and
images/s per strategy, in plain formulas with nothing fitted to the runs
they are compared with.

A step is one global batch: one synchronous update, or one update of each
asynchronous parameter-server worker. Links are full duplex: each direction
carries its own bytes at the link's rate B (bytes/s).

Bytes per step, with N workers, G gradient bytes (trainable parameters x 4,
or x 2 with fp16 all-reduce) and M variable bytes (every parameter, fp32):

  all-reduce (a ring)   each worker sends and receives 2(N-1)/N x G.
  parameter server      a worker reads R x M (R reads of each variable per
                        update: 1, the forward pass's, since the weight decay
                        is applied on the ps tasks) and sends its G.
    separate            every ps task on a host of its own: that host's link
                        sends N x R x M and receives N x G.
    colocated           a ps task beside each worker, holding a share s_h of
                        the model on host h (the partitioner decides it): a
                        host's worker reads (1 - s_h) of the model over the
                        link and its ps serves s_h to the N - 1 others, so
                        the link receives R M (1 - s_h) + (N - 1) G s_h and
                        sends G (1 - s_h) + (N - 1) R M s_h. With s_h = 1/N
                        and R = 1 that is (1 + R) M (N-1)/N each way: a
                        ring's 2 G (N-1)/N.

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
  parameter server      the slowest of each worker's own path, c + (what it
                        reads and sends over its link) / B, and each link's
                        load, max(sent, received) / B, over all hosts. A
                        separate ps host's link is B_ps; a worker's own path
                        to a separate ps is B_w (its host's link, or within
                        one host its PCIe lanes).
    synchronous         (as TensorFlow 1.x ran it, SyncReplicasOptimizer's
                        barrier; not this project's, which is asynchronous)
                        all workers read at a step's start and send at its
                        end, past a barrier, so no link's load is beside the
                        compute: each link's is c + (max(read bytes sent,
                        received) + max(gradient bytes sent, received)) / B.

Host CPUs, where a host's CPUs are known (its vCPUs V, and the core-seconds
the training asks of them: d per training image decoded and cropped, a per
gradient byte a ps task takes in and applies, v per variable byte it serves),
a step is at least the busiest host's CPU time:

  worker host           its images per step x d  (d = 0 on synthetic data)
  parameter server      N (a G + v R M) for all ps tasks: on the workers'
                        host when one host holds them all, on a host of
                        its own when separate, a share s_h on each host
                        when colocated.

  each host's CPU time  its core-seconds / V

  img/s = global batch / max(time per step, the busiest host's CPU time).

A straggler, one of the N workers k times slower (its host's CPU quota
divided by k), from the img/s r measured with none, on the same links:

  all-reduce            r / (k - (k - 1) e): a step waits for the slowest
                        worker's compute, c k, and the exchange, a share e
                        of the even step (e = 0 when compute-bound).
  parameter server      r (N - 1 + 1/k) / N: each worker updates at its own
                        pace, so their rates add up (within the ps links'
                        limit, which the even run's r is already within).

A lost worker (killed; the others are not), with t the time a training
takes to start and E an epoch's time, both measured without kills:

  restart from the last checkpoint (each epoch's end; the synchronous
  strategies)           t + E/2 lost a kill, on average
  parameter server      t / N: the others go on while the killed worker's
                        task starts again, and the coordinator reruns its step
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # of a worker's compute: the backward pass does twice the forward's work
PS_READS = 1  # reads of each variable per parameter-server update: the forward pass's


@dataclass(frozen=True)
class Links:
    """Bytes/s of each link, each way."""

    hosts: float  # a host's link to the others (its NIC; here the shaped veth)
    devices: float  # between two workers of one host (NVLink, PCIe)
    worker_ps: float  # a worker's own path to separate ps tasks
    ps: float  # the link of separate ps tasks' host (or the PCIe to the CPU hosting them)


@dataclass(frozen=True)
class Setting:
    workers: int
    workers_per_host: int
    global_batch: int
    compute_s: float  # one worker's compute time per update
    ps_shares: tuple[float, ...] = ()  # colocated ps: the model's share on each worker's host
    reads: float = PS_READS
    synchronous: bool = False  # a parameter server's workers step together (see the formulas)


@dataclass(frozen=True)
class HostCPU:
    """A host's vCPUs and the core-seconds the training asks of them
    (benchmarks/cpu_costs.json, measured on a vCPU of the machine it ran on)."""

    vcpus: int
    decode_s: float  # per training image (0 on synthetic data)
    ps_apply_s: float  # per gradient byte a ps task takes in and applies
    ps_serve_s: float  # per variable byte a ps task serves


def gradient_bytes(trainable_parameters: int, fp16_allreduce: bool) -> float:
    return trainable_parameters * (2 if fp16_allreduce else 4)


def variable_bytes(parameters: int) -> float:
    return parameters * 4  # fp32 master variables, also under mixed precision


def ring_bytes(workers: int, gradients: float) -> float:
    """What each worker sends (and receives) per all-reduce of a ring."""
    return 2 * (workers - 1) / workers * gradients


@dataclass(frozen=True)
class HostLink:
    """What one host's link carries in a parameter-server step: the
    variables' reads and the gradients, each way."""

    own: float  # bytes its worker reads and sends on its own path (0: a ps host)
    reads_sent: float
    reads_received: float
    gradients_sent: float
    gradients_received: float
    link: str  # which of Links it is

    @property
    def sent(self) -> float:
        return self.reads_sent + self.gradients_sent

    @property
    def received(self) -> float:
        return self.reads_received + self.gradients_received


def ps_links(setting: Setting, gradients: float, variables: float) -> list[HostLink]:
    """Every host's link in a parameter-server step (see the module's formulas):
    the workers' hosts, then a separate ps host."""
    n, read = setting.workers, setting.reads * variables
    if not setting.ps_shares:
        worker = HostLink(read + gradients, 0.0, read, gradients, 0.0, "worker_ps")
        return [worker] * n + [HostLink(0.0, n * read, 0.0, 0.0, n * gradients, "ps")]
    return [
        HostLink(
            (read + gradients) * (1 - share),
            (n - 1) * read * share,
            read * (1 - share),
            gradients * (1 - share),
            (n - 1) * gradients * share,
            "hosts",
        )
        for share in setting.ps_shares
    ]


def expected_bytes(
    exchange: str, setting: Setting, gradients: float, variables: float
) -> dict[str, dict[str, float]]:
    """Bytes per step on a worker's link and on a separate ps host's, each
    way (colocated: the mean over the workers' hosts, each with its ps)."""
    if exchange == "all-reduce":
        each = ring_bytes(setting.workers, gradients)
        return {"worker": {"sent": each, "received": each}}
    links = ps_links(setting, gradients, variables)
    if setting.ps_shares:
        mean = {
            way: sum(getattr(h, way) for h in links) / len(links) for way in ("sent", "received")
        }
        return {"worker": mean}
    return {
        role: {"sent": host.sent, "received": host.received}
        for role, host in (("worker", links[0]), ("ps", links[-1]))
    }


def step_time(
    exchange: str,
    overlap: float,
    setting: Setting,
    links: Links,
    gradients: float,
    variables: float,
    cpu: HostCPU | None = None,
) -> float:
    """Seconds per step (see the module's formulas): the slowest of compute
    and links, and of the hosts' CPUs where they are given."""
    n, c = setting.workers, setting.compute_s
    if exchange == "all-reduce":
        spans_hosts = n > setting.workers_per_host
        edge = links.hosts if spans_hosts else links.devices
        communication = ring_bytes(n, gradients) / edge
        slowest = c + max(0.0, communication - overlap * BACKWARD_SHARE * c)
    else:
        slowest = 0.0
        for host in ps_links(setting, gradients, variables):
            rate = getattr(links, host.link)
            own = c + host.own / rate if host.own else 0.0
            if setting.synchronous:
                reads = max(host.reads_sent, host.reads_received)
                load = c + (reads + max(host.gradients_sent, host.gradients_received)) / rate
            else:
                load = max(host.sent, host.received) / rate
            slowest = max(slowest, own, load)
    if cpu is None:
        return slowest
    return max(slowest, cpu_time(exchange, setting, cpu, gradients, variables))


def cpu_time(
    exchange: str, setting: Setting, cpu: HostCPU, gradients: float, variables: float
) -> float:
    """Seconds of the busiest host's CPUs per step (see the module's formulas)."""
    n = setting.workers
    on_one_host = min(n, setting.workers_per_host)
    decode = on_one_host * setting.global_batch / n * cpu.decode_s
    if exchange == "all-reduce":
        return decode / cpu.vcpus
    ps = n * (gradients * cpu.ps_apply_s + setting.reads * variables * cpu.ps_serve_s)
    if setting.ps_shares:
        busiest = decode + ps * max(setting.ps_shares)
    elif math.ceil(n / setting.workers_per_host) == 1:
        busiest = decode + ps
    else:
        busiest = max(decode, ps)
    return busiest / cpu.vcpus


def overlap(most: float, ready_within_s: float | None, compute_s: float) -> float:
    """o: the strategy's `most`, bounded by how long the gradients take to
    become ready (when measured) against the backward pass."""
    if ready_within_s is None:
        return most
    return min(most, ready_within_s / (BACKWARD_SHARE * compute_s))


def gbit(value: float) -> float:
    """Gbit/s -> bytes/s."""
    return value * 1e9 / 8


def straggler_rate(
    exchange: str, even_rate: float, workers: int, slowdown: float, exchange_share: float = 0.0
) -> float:
    """img/s with one of the workers `slowdown` times slower, from even_rate
    with none (see the module's formulas)."""
    if exchange == "all-reduce":
        return even_rate / (slowdown - (slowdown - 1) * exchange_share)
    return even_rate * (workers - 1 + 1 / slowdown) / workers


def seconds_lost_per_kill(exchange: str, start_up_s: float, epoch_s: float, workers: int) -> float:
    """Seconds a training loses when one worker is killed (see the module's formulas)."""
    if exchange == "all-reduce":
        return start_up_s + epoch_s / 2
    return start_up_s / workers
