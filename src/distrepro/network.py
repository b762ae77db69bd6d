"""One training of the network experiment, on hosts of its own: network
namespaces joined by a switch (scripts/hosts.sh), each host's link shaped to
network.bandwidth in both directions (`tc tbf`; "unshaped": none). node1, the
head, runs the launcher and the parameter server's coordinator (and its ps
tasks with strategy.ps_placement=separate); node2, node3.. a worker each (and
a ps task beside it, colocated: the default across machines). With network.slowdown, each
worker's host gets strategy.cores_per_worker cores by a CPU quota, the last
one's divided by the slowdown: a straggler. With network.kill_interval_s,
the last worker's training processes are killed at random times
(distrepro.kills), and each strategy recovers its own way.

Before training, the link's rate is measured (one TCP stream, node2 to
node1); while training, the switch's port counters are sampled; afterwards
run_dir/network.json holds what each host sent and received per step (a
global batch; TCP payload, and with the headers the port counted) over the
timed part of every epoch but the first, beside what
the model's size implies (costmodel), the worker hosts' CPU quotas and the
seconds the kernel held them back, the kills and the launcher's restarts;
the MLflow run gets the figures.

    python -m distrepro.network network.bandwidth=10mbit [OVERRIDES..]   (as root)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distrepro import costmodel, strategies
from distrepro.atomic import write_json_atomically
from distrepro.config import REPO, compose_config, run_name, sweep_axes
from distrepro.handoff import ON_SHAPED_HOSTS
from distrepro.kills import Kills
from distrepro.processes import end_with_parent, start, stop

HOSTS_SH = str(REPO / "scripts" / "hosts.sh")
HEAD = "node1"
RATE = re.compile(r"^[0-9]+(kbit|mbit|gbit)$")
UNSHAPED = "unshaped"
PROBE_PORT = 5201
PROBE_S = 2.0
SAMPLE_S = 0.25
# What a port counts of each TCP packet besides its payload: the Ethernet (14),
# IPv4 (20) and TCP (20, and 12 of timestamps) headers. The kernel's
# segmentation offload sends fewer, larger packets on a fast link than on a
# slow one, so only the payload compares across links and with the model.
HEADER_BYTES = 66
TOOLS = ("ip", "tc", "ssh", "sshd", "unshare")


class NetworkError(ValueError):
    """The experiment cannot run here, or network.bandwidth cannot be read."""


def megabit(bandwidth: str) -> float:
    number, unit = bandwidth[:-4], bandwidth[-4:]
    return float(number) * {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}[unit]


def variants(strategy: str, grid: str) -> list[list[str]]:
    """The settings of a strategy that a grid (Hydra's sweep grammar over
    strategy.* keys) asks for: the product of the axes whose key it takes;
    the other keys are other strategies'."""
    own = strategies.module(strategy).KEYS
    axes = [axis for axis in sweep_axes(grid) if axis[0].split("=")[0].split(".")[-1] in own]
    return [list(point) for point in itertools.product(*axes)]


@functools.cache
def shipped(strategy: str) -> DictConfig:
    """The strategy's group as composed on one machine: its own keys (its
    module's KEYS) at its library's defaults."""
    return compose_config([f"strategy={strategy}"]).strategy


def override(key: str, value) -> str:
    """A key of the strategy group and its value as a Hydra override."""
    return f"strategy.{key}={str(value).lower()}"


@functools.cache
def library_defaults(strategy: str) -> tuple[str, ...]:
    """The strategy's own keys that default otherwise across several machines
    (`${on_several_hosts:..}`), as on one: its library's defaults, the
    baseline the network experiment measures the winners against."""
    ships = shipped(strategy)
    return tuple(
        override(key, ships[key])
        for key in strategies.module(strategy).KEYS
        if OmegaConf.is_interpolation(ships, key)
    )


def layout(num_workers: int) -> str:
    """strategy.hosts of the experiment: the head with no worker slot, then a
    host per worker."""
    return ",".join([f"{HEAD}:0", *(f"node{i + 2}:1" for i in range(num_workers))])


def validate(cfg: DictConfig) -> None:
    bandwidth = cfg.network.bandwidth
    if bandwidth is None:
        raise NetworkError("network.bandwidth is not set: give a rate (10mbit, 1gbit) or unshaped")
    if bandwidth != UNSHAPED and not RATE.match(bandwidth):
        raise NetworkError(
            f"network.bandwidth={bandwidth!r} is not a rate in tc's units (10mbit, 1gbit) "
            f"or {UNSHAPED!r}"
        )
    slowdown = cfg.network.slowdown
    if slowdown is not None and not slowdown >= 1:
        raise NetworkError(f"network.slowdown={slowdown} must be at least 1 (1: no straggler)")
    validate_kills(cfg)
    if cfg.strategy.hosts != layout(cfg.strategy.num_workers):
        raise NetworkError(
            f"strategy.hosts={cfg.strategy.hosts!r}: the network experiment places the "
            f"processes itself ({layout(cfg.strategy.num_workers)!r}); leave it unset"
        )
    refused = refusal()
    if refused:
        raise NetworkError(refused)


def validate_kills(cfg: DictConfig) -> None:
    net, train_cfg = cfg.network, cfg.train
    if net.kill_interval_s is None:
        return
    if not net.kill_interval_s > 0:
        raise NetworkError(f"network.kill_interval_s={net.kill_interval_s} must be above 0")
    if not 1 <= net.max_kills <= train_cfg.max_restarts:
        raise NetworkError(
            f"network.max_kills={net.max_kills} must be at least 1 and at most "
            f"train.max_restarts={train_cfg.max_restarts}, past which a run gives up"
        )
    if cfg.strategy.num_workers < 2:
        raise NetworkError(
            f"strategy.num_workers={cfg.strategy.num_workers}: kills never hit the chief's "
            "host, the first worker's; give at least 2 workers"
        )


def refusal() -> str | None:
    """Why this machine cannot make the experiment's hosts, or None."""
    if os.geteuid() != 0:
        return (
            "the network experiment makes hosts of network namespaces and shapes their links "
            "with tc: run it as root"
        )
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if re.match(r"https?://(localhost|127\.)", uri):
        return (
            f"MLFLOW_TRACKING_URI={uri}: the hosts have loopbacks of their own; use the "
            "default store (sqlite) or a server address they can reach"
        )
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing:
        return f"the network experiment needs {', '.join(missing)}: run `scripts/packages.sh test`"
    return None


def hosts_sh(action: str, folder: Path, *args: str) -> list[str]:
    """scripts/hosts.sh ACTION DIR ARGS.."""
    return [HOSTS_SH, action, str(folder), *args]


def link_rate(folder: Path) -> float:
    """Bytes/s of one TCP stream from node2 to the head, over two links."""
    python = [sys.executable, "-m", "distrepro.network"]
    receiver = subprocess.Popen(
        hosts_sh("run", folder, HEAD, *python, "receive"), stdout=subprocess.PIPE, text=True
    )
    try:
        subprocess.run(hosts_sh("run", folder, "node2", *python, "send", HEAD), check=True)
        return float(receiver.communicate(timeout=60)[0])
    finally:
        receiver.kill()


def receive() -> None:
    """Print the bytes/s of the first connection, from its first byte to its end."""
    with socket.create_server((HEAD, PROBE_PORT)) as server:
        connection, _ = server.accept()
        received, first = 0, None
        while chunk := connection.recv(1 << 16):
            first = first or time.monotonic()
            received += len(chunk)
        print(received / (time.monotonic() - first))


def send(host: str) -> None:
    """Send for PROBE_S seconds, once the receiver listens."""
    data = b"\0" * (1 << 16)
    for _ in range(100):
        try:
            connection = socket.create_connection((host, PROBE_PORT), timeout=5)
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"network: nothing listens on {host}:{PROBE_PORT}")
    with connection:
        until = time.monotonic() + PROBE_S
        while time.monotonic() < until:
            connection.sendall(data)


class Counters:
    """The switch's port counters, sampled in a thread: (time, {host: [bytes
    sent, bytes received, packets sent, packets received]}); port i is node
    i's cable, its rx what the host sent."""

    def __init__(self, folder: Path):
        self.switch = next(
            ns for ns in (folder / "namespaces").read_text().split() if ns.endswith("-switch")
        )
        self.samples: list[tuple[float, dict[str, list[int]]]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def read(self) -> dict[str, list[int]]:
        listing = subprocess.run(
            ["ip", "-n", self.switch, "-s", "-j", "link", "show"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return {
            f"node{link['ifname'][len('port') :]}": [
                link["stats64"][way][unit] for unit in ("bytes", "packets") for way in ("rx", "tx")
            ]
            for link in json.loads(listing)
            if link["ifname"].startswith("port")
        }

    def sample(self) -> None:
        while not self.done.is_set():
            # the kernel counted somewhere within `ip`'s run, which a loaded
            # machine stretches to a good part of SAMPLE_S: its middle
            started = time.time()
            counters = self.read()
            self.samples.append(((started + time.time()) / 2, counters))
            self.done.wait(SAMPLE_S)

    def __enter__(self) -> Counters:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def at(self, when: float) -> dict[str, list[float]]:
        """The counters at `when`, interpolated between samples."""
        before = max((s for s in self.samples if s[0] <= when), key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] >= when), key=lambda s: s[0])
        share = (when - before[0]) / (after[0] - before[0]) if after[0] > before[0] else 0.0
        return {
            host: [
                b + share * (a - b) for b, a in zip(before[1][host], after[1][host], strict=True)
            ]
            for host in before[1]
        }


def bytes_per_step(counters: Counters, history: list[dict], global_batch: int) -> dict:
    """Bytes each host sent and received per step over the timed parts of the
    epochs after the first (those the sampling covers): as the port counted
    them (wire_per_step) and their TCP payload (per_step)."""
    first, last = counters.samples[0][0], counters.samples[-1][0]
    windows = [
        (record["timed_window"], record["images_per_sec"])
        for record in history[1:]
        if first <= record["timed_window"][0] and record["timed_window"][1] <= last
    ]
    if not windows:
        raise NetworkError("no timed epoch after the first lies within the counters' samples")
    totals: dict[str, list[float]] = {}
    steps = 0.0
    for (start_s, end_s), rate in windows:
        begin, end = counters.at(start_s), counters.at(end_s)
        for host in begin:
            moved = [e - b for b, e in zip(begin[host], end[host], strict=True)]
            totals[host] = [t + m for t, m in zip(totals.get(host, [0.0] * 4), moved, strict=True)]
        steps += rate * (end_s - start_s) / global_batch
    wire, payload = {}, {}
    for host, (sent, received, sent_packets, received_packets) in sorted(totals.items()):
        wire[host] = {"sent": sent / steps, "received": received / steps}
        payload[host] = {
            "sent": (sent - HEADER_BYTES * sent_packets) / steps,
            "received": (received - HEADER_BYTES * received_packets) / steps,
        }
    return {"steps": steps, "per_step": payload, "wire_per_step": wire}


def worker_hosts(num_workers: int) -> list[str]:
    return [f"node{i + 2}" for i in range(num_workers)]


def last_worker_host(num_workers: int) -> str:
    """Where the straggler is and the kills hit: never the chief's host (the
    first worker's: TensorFlow's chief worker, Horovod's rank 0), nor the
    parameter server's head."""
    return worker_hosts(num_workers)[-1]


def quotas(cfg: DictConfig) -> dict[str, float]:
    """The cores of each worker's host under network.slowdown, the last
    one's divided by it; {} without a slowdown."""
    if cfg.network.slowdown is None:
        return {}
    n = cfg.strategy.num_workers
    cores = {host: float(cfg.strategy.cores_per_worker) for host in worker_hosts(n)}
    cores[last_worker_host(n)] /= cfg.network.slowdown
    return cores


def host_namespaces(folder: Path) -> dict[str, str]:
    """Each host's network namespace, also the name of its cgroup."""
    return {ns.rsplit("-", 1)[1]: ns for ns in (folder / "namespaces").read_text().split()}


def throttled_s(folder: Path, hosts: list[str]) -> dict[str, float]:
    """Seconds each host's processes were held back by its CPU quota (cgroup v1)."""
    groups = host_namespaces(folder)
    held = {}
    for host in hosts:
        stat = Path(f"/sys/fs/cgroup/cpu/{groups[host]}/cpu.stat").read_text().split()
        held[host] = int(dict(zip(stat[::2], stat[1::2], strict=True))["throttled_time"]) / 1e9
    return held


def by_role(per_step: dict, num_workers: int, roles: dict) -> dict:
    """Measured bytes per step on a worker's link (their mean) and, where
    the roles have one, the separate ps host's (the head's)."""
    workers = [per_step[host] for host in worker_hosts(num_workers)]
    measured = {
        "worker": {way: sum(w[way] for w in workers) / num_workers for way in ("sent", "received")}
    }
    if "ps" in roles:
        measured["ps"] = per_step[HEAD]
    return measured


def model_inputs(cfg: DictConfig, metrics: dict, compute_s: float = 0.0) -> tuple:
    """(setting, gradient bytes, variable bytes) of a run for the cost model."""
    strategy = strategies.of(cfg)
    setting = costmodel.Setting(
        workers=cfg.strategy.num_workers,
        workers_per_host=1,
        global_batch=cfg.train.global_batch_size,
        compute_s=compute_s,
        ps_shares=strategy.host_shares(cfg, metrics.get("ps_shares")),
    )
    gradients = costmodel.gradient_bytes(
        metrics["trainable_parameters"], cfg.strategy.fp16_allreduce
    )
    return setting, gradients, costmodel.variable_bytes(metrics["parameters"])


def expected(cfg: DictConfig, metrics: dict) -> dict:
    return costmodel.expected_bytes(strategies.of(cfg).EXCHANGE, *model_inputs(cfg, metrics))


def reads_per_update(cfg: DictConfig, metrics: dict, per_step: dict) -> float | None:
    """R as measured: what a parameter-server worker's host received beyond
    its ps's share of gradients, over the model bytes it had to read (the
    mean over the workers' hosts); None for an all-reduce. The framing of
    every tensor counts too: 1.25 colocated, sharded in two, at 10 Mbit/s."""
    if strategies.of(cfg).EXCHANGE != "parameter server":
        return None
    setting, gradients, variables = model_inputs(cfg, metrics)
    shares = setting.ps_shares or (0.0,) * setting.workers
    n = setting.workers
    reads = [
        (per_step[host]["received"] - (n - 1) * gradients * share) / (variables * (1 - share))
        for host, share in zip(worker_hosts(n), shares, strict=True)
    ]
    return sum(reads) / n


def kill_schedule(cfg: DictConfig, folder: Path):
    """network.kill_interval_s's kills of the last worker's training
    processes while the launcher runs (Kills), or nothing."""
    if cfg.network.kill_interval_s is None:
        return contextlib.nullcontext()
    host, net = last_worker_host(cfg.strategy.num_workers), cfg.network
    schedule = f"{net.kill_seed}/{cfg.seed}"  # each strategy the same kills at a seed
    return Kills(host_namespaces(folder)[host], host, net.kill_interval_s, schedule, net.max_kills)


def train(cfg: DictConfig, overrides: list[str]) -> Path:
    """Make the hosts, measure a shaped link, train on them, take the counters
    down with everything else; write and log run_dir/network.json."""
    run_dir = Path(cfg.results_dir) / run_name(cfg)
    if (run_dir / "network.json").exists():
        print(f"{run_dir} is complete; nothing to do")
        return run_dir
    if (run_dir / "metrics.json").exists():
        raise NetworkError(
            f"{run_dir} finished training but has no network.json: its link counters are lost; "
            "move the directory away to train it again"
        )
    subprocess.run([HOSTS_SH, "down", "--stale"], check=True)  # what killed runs left
    folder = Path(tempfile.mkdtemp(prefix="distrepro-hosts-"))
    rate = [] if cfg.network.bandwidth == UNSHAPED else [cfg.network.bandwidth]
    hosts = str(cfg.strategy.num_workers + 1)
    try:
        subprocess.run(hosts_sh("up", folder, hosts, *rate), check=True)
        cores = quotas(cfg)
        for host, share in cores.items():
            subprocess.run(hosts_sh("cpu", folder, host, f"{share:g}"), check=True)
        measured_rate = link_rate(folder) if rate else None  # unshaped: nothing to predict from
        carry = f"{rate[0]} links carry {measured_rate / 1e6:.2f} MB/s" if rate else "unshaped"
        print(f"network: hosts up; {carry}", flush=True)
        launch = [sys.executable, "-m", "distrepro.launch", *overrides]
        launched_at = time.time()
        with Counters(folder) as counters, kill_schedule(cfg, folder) as kills:
            launcher = start(hosts_sh("run", folder, HEAD, *launch), {ON_SHAPED_HOSTS: "1"})
            try:
                code = launcher.wait()
            finally:
                stop([launcher])
        wall_s = time.time() - launched_at
        if code:
            raise SystemExit(f"network: the launcher exited with {code}")
        held = throttled_s(folder, list(cores))
    finally:
        subprocess.run(hosts_sh("down", folder), check=True)
        shutil.rmtree(folder)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    restarts = run_dir / "restarts.json"
    moved = bytes_per_step(counters, metrics["history"], cfg.train.global_batch_size)
    roles = expected(cfg, metrics)
    record = {
        "bandwidth": cfg.network.bandwidth,
        "link_bytes_per_s": measured_rate,
        "exchange": strategies.of(cfg).EXCHANGE,
        **moved,
        "measured": by_role(moved["per_step"], cfg.strategy.num_workers, roles),
        "measured_wire": by_role(moved["wire_per_step"], cfg.strategy.num_workers, roles),
        "expected": roles,
        "reads_per_update": reads_per_update(cfg, metrics, moved["per_step"]),
        "slowdown": cfg.network.slowdown,
        "cpu": {host: {"cores": cores[host], "throttled_s": held[host]} for host in cores},
        "launched_at": launched_at,
        "wall_s": wall_s,
        "kill_interval_s": cfg.network.kill_interval_s,
        "kills": kills.records if kills else [],
        "recoveries": json.loads(restarts.read_text()) if restarts.exists() else [],
    }
    write_json_atomically(run_dir / "network.json", record)
    from distrepro import tracking  # mlflow: 2 s to import, not for the probe's receive/send

    tracking.log_network(run_dir, record)
    return run_dir


def main(argv: list[str]) -> None:
    if argv[:1] == ["receive"]:
        return receive()
    if argv[:1] == ["send"]:
        return send(argv[1])
    # SIGTERM (Snakemake's end, a scheduler) unwinds, so that the hosts come down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    end_with_parent(signal.SIGTERM)
    overrides = list(argv)
    cfg = compose_config(overrides)
    if cfg.strategy.hosts is None:
        overrides.append(f"strategy.hosts='{layout(cfg.strategy.num_workers)}'")
        cfg = compose_config(overrides)
    try:
        validate(cfg)
        run_dir = train(cfg, overrides)
    except NetworkError as error:
        raise SystemExit(f"network: {error}") from None
    print(json.dumps(json.loads((run_dir / "network.json").read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
