"""Horovod: `horovodrun` starts one rank per worker; each rank averages its
gradients with the others' (allreduce over Gloo, MPI or NCCL).

With strategy.elastic, horovodrun runs the ranks that its host discovery
script lists (at least strategy.min_workers): when a rank fails, its host is
left out for a cool-down, the others restore their last commit and go on,
and the host's ranks rejoin after it.

In a SLURM job of several nodes the ranks are one job step instead (srun,
no ssh): over MPI through PMIx (`srun --mpi=pmix`), over Gloo with the
launcher holding the rendezvous that horovodrun would.

The launcher side (`run`) imports no TensorFlow; the ranks run
`python -m distrepro.strategies.horovod CONFIG`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import socket
import sys
from pathlib import Path

from horovod.common.elastic import ObjectState
from omegaconf import DictConfig

from distrepro import hosts, slurm
from distrepro.config import ConfigError
from distrepro.handoff import AUTOTUNE_LOG
from distrepro.processes import Restarts, process_env, start, stop
from distrepro.strategies.synchronous import (  # noqa: F401  (the interface)
    host_shares,
    images_per_update,
    processes,
    updates_per_call,
)
from distrepro.training.distribution import Distribution, main

MODULE = "distrepro.strategies.horovod"
KEYS = (
    "controller",
    "fp16_allreduce",
    "fusion_threshold_mb",
    "cycle_time_ms",
    "autotune",
    "elastic",
    "min_workers",
    "commit_every",
)
EXCHANGE = "all-reduce"
BACKWARD_OVERLAP = 1.0  # Horovod reduces each gradient as the backward pass produces it
DISCOVERY_SCRIPT = "discover_hosts.sh"
ELASTIC_HOSTS = "elastic_hosts"  # what the discovery script lists; edit it to add or drop hosts
COOLDOWN_S = (5, 60)  # a failed host is left out this long, doubling with each failure
# Horovod's elastic mode leaves out the whole host of a failed rank. On one
# machine two names for it (each local) make two "hosts", so that one failed
# rank does not take every rank with it.
LOCAL_NAMES = ("localhost", "127.0.0.1")
GLOO_SLOTS = "DISTREPRO_HOROVOD_SLOTS"  # under SLURM: each Gloo rank's HOROVOD_* variables


def local_hosts(num_workers: int) -> list[tuple[str, int]]:
    """(host, slots) of an elastic run on this machine alone."""
    first = math.ceil(num_workers / 2)
    named = [(LOCAL_NAMES[0], first)]
    if num_workers > first:
        named.append((LOCAL_NAMES[1], num_workers - first))
    return named


def elastic_hosts(cfg: DictConfig) -> list[tuple[str, int]]:
    return hosts.of_run(cfg) or local_hosts(cfg.strategy.num_workers)


def write_discovery_script(cfg: DictConfig, run_dir: Path) -> Path:
    """run_dir/discover_hosts.sh prints run_dir/elastic_hosts, written from the
    config when missing."""
    listed = run_dir / ELASTIC_HOSTS
    if not listed.exists():
        listed.write_text("".join(f"{host}:{n}\n" for host, n in elastic_hosts(cfg) if n))
    script = run_dir / DISCOVERY_SCRIPT
    script.write_text(f"#!/bin/sh\nexec cat '{listed.resolve()}'\n")
    script.chmod(0o755)
    return script


def command(cfg: DictConfig, config_path: Path) -> list[str]:
    n = cfg.strategy.num_workers
    controller = "--mpi" if cfg.strategy.controller == "mpi" else "--gloo"
    program = [sys.executable, "-m", MODULE, str(config_path)]
    horovodrun = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(n)]
    machines = hosts.of_run(cfg)
    if not cfg.strategy.elastic:
        listed = ",".join(
            f"{host}:{slots}" for host, slots in machines or [("localhost", n)] if slots
        )
        return [*horovodrun, "-H", listed, controller, *program]
    elastic = [
        *("--min-np", str(cfg.strategy.min_workers), "--max-np", str(n)),
        *("--host-discovery-script", str(config_path.parent / DISCOVERY_SCRIPT)),
        *("--blacklist-cooldown-range", *map(str, COOLDOWN_S)),
    ]
    if not machines:
        elastic += ["--network-interface", "lo"]
    return [*horovodrun, *elastic, controller, *program]


def validate(cfg: DictConfig) -> None:
    strategy = cfg.strategy
    if "TF_CONFIG" in os.environ:
        raise ConfigError("TF_CONFIG is for TensorFlow's strategies; horovodrun places the ranks")
    if strategy.controller not in ("gloo", "mpi"):
        raise ConfigError(f"strategy.controller={strategy.controller} must be gloo or mpi")
    if strategy.gpus_per_worker > 1:
        raise ConfigError(
            f"strategy.gpus_per_worker={strategy.gpus_per_worker}: Horovod uses one GPU per "
            "rank; ask for more ranks (strategy.num_workers) instead"
        )
    if strategy.fusion_threshold_mb is not None and strategy.fusion_threshold_mb < 0:
        raise ConfigError(
            f"strategy.fusion_threshold_mb={strategy.fusion_threshold_mb} must be at least 0 "
            "(0: no fusion)"
        )
    if strategy.cycle_time_ms is not None and strategy.cycle_time_ms <= 0:
        raise ConfigError(f"strategy.cycle_time_ms={strategy.cycle_time_ms} must be above 0")
    if not strategy.elastic:
        return
    if slurm.in_job_of_several_nodes():
        raise ConfigError(
            "strategy.elastic=true: horovodrun starts elastic ranks over ssh, and a SLURM job "
            "starts its processes by srun; run it without strategy.elastic"
        )
    if strategy.controller != "gloo":
        raise ConfigError(
            f"strategy.elastic=true runs over Gloo, not strategy.controller={strategy.controller}"
        )
    if not 1 <= strategy.min_workers <= strategy.num_workers:
        raise ConfigError(
            f"strategy.min_workers={strategy.min_workers} must be between 1 and "
            f"strategy.num_workers={strategy.num_workers}"
        )
    if strategy.commit_every < 1 or strategy.commit_every % strategy.steps_per_call:
        raise ConfigError(
            f"strategy.commit_every={strategy.commit_every} must be a multiple of "
            f"strategy.steps_per_call={strategy.steps_per_call}: a commit falls between calls"
        )


def describe(cfg: DictConfig) -> str:
    if slurm.in_job_of_several_nodes():  # run_step
        placed = ",".join(f"{host}:{n}" for host, n in hosts.of_run(cfg) if n)
        return f"Horovod ranks over {cfg.strategy.controller} as one SLURM job step on {placed}"
    horovodrun = command(cfg, Path("config.yaml"))
    options = horovodrun[1 : horovodrun.index(sys.executable)]
    return shlex.join(["horovodrun", *options, "python", "-m", MODULE])


def tuning_env(cfg: DictConfig, run_dir: Path) -> dict[str, str]:
    """strategy.fusion_threshold_mb, cycle_time_ms and autotune as the
    variables that horovodrun's flags set and every rank reads."""
    strategy, env = cfg.strategy, {}
    if strategy.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(strategy.fusion_threshold_mb * 2**20))
    if strategy.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(strategy.cycle_time_ms)
    if strategy.autotune:
        env |= {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(run_dir / AUTOTUNE_LOG)}
    return env


def run(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    """Run the job once; return why it failed, or None."""
    if cfg.strategy.elastic:
        write_discovery_script(cfg, config_path.parent)
    if slurm.in_job_of_several_nodes():
        return run_step(cfg, config_path)
    env = process_env(cfg) | tuning_env(cfg, config_path.parent)
    proc = start(command(cfg, config_path), env)
    try:
        code = proc.wait()
    finally:
        stop([proc])
    return f"horovodrun exited with {code}" if code else None


def run_step(cfg: DictConfig, config_path: Path) -> str | None:
    """The ranks as one step of this SLURM job, on the nodes hosts.of_run gives."""
    machines = [(host, slots) for host, slots in hosts.of_run(cfg) if slots]
    program = [sys.executable, "-m", MODULE, str(config_path)]
    mpi = cfg.strategy.controller == "mpi"
    with contextlib.ExitStack() as stack:
        env = process_env(cfg) | tuning_env(cfg, config_path.parent)
        env |= {} if mpi else stack.enter_context(gloo_rendezvous(machines))
        proc = start(slurm.step(machines, program, "horovod", "pmix" if mpi else None), env)
        try:
            code = proc.wait()
        finally:
            stop([proc])
    return f"the ranks' job step (srun) exited with {code}" if code else None


@contextlib.contextmanager
def gloo_rendezvous(machines: list[tuple[str, int]]):
    """What `horovodrun --gloo` sets up before it starts the ranks over ssh: a
    rendezvous server here, and the environment of the ranks, each rank's
    place (its HOROVOD_* variables) among them, which a rank started by srun
    takes by its SLURM_PROCID (take_gloo_slot)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    listed = ",".join(f"{host}:{slots}" for host, slots in machines)
    plan = get_host_assignments(parse_hosts(listed), sum(slots for _, slots in machines))
    server = RendezvousServer()
    port = server.start()
    try:
        server.init(plan)
        address, interface = address_towards(machines[-1][0])
        env = create_run_env_vars(address, [interface], port)
        yield {k: str(v) for k, v in env.items()} | {
            GLOO_SLOTS: json.dumps([create_slot_env_vars(slot) for slot in plan])
        }
    finally:
        server.stop()


def address_towards(host: str) -> tuple[str, str]:
    """This machine's address on the route to host, and its interface."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # sends nothing: only picks the route
        address = probe.getsockname()[0]
    interfaces = psutil.net_if_addrs().items()
    return address, next(name for name, ips in interfaces if address in (a.address for a in ips))


def take_gloo_slot(environ=os.environ) -> None:
    """A Gloo rank started by srun: its HOROVOD_* variables, which horovodrun
    would have set, from the launcher's plan by its SLURM_PROCID."""
    slots = environ.pop(GLOO_SLOTS, None)
    if slots is None:
        return
    rank, node = environ["SLURM_PROCID"], environ.get("SLURMD_NODENAME")
    mine = json.loads(slots)[int(rank)]
    if mine["HOROVOD_HOSTNAME"] != node:
        raise SystemExit(
            f"horovod: SLURM started rank {rank} on {node}; the rendezvous expects it "
            f"on {mine['HOROVOD_HOSTNAME']}"
        )
    environ.update(mine)


class ElasticState(ObjectState):
    """What a restoring or joining rank needs: the model's and optimizer's
    variables (kept in host memory at each commit, broadcast from rank 0 at
    each sync) and plain values such as the history. Horovod's own
    TensorFlowKerasState calls optimizer.variables(), a property in tf_keras."""

    def __init__(self, variables: list, **values):
        import horovod.tensorflow as hvd

        self.variables = variables
        self._save_variables()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **values)

    def _save_variables(self) -> None:
        self._saved_variables = [variable.numpy() for variable in self.variables]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self._saved_variables, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        import horovod.tensorflow as hvd

        hvd.broadcast_variables(self.variables, root_rank=0)
        self._save_variables()
        super().sync()


def gpu_index(cfg: DictConfig, local_rank: int) -> int:
    """This rank's GPU on its host; under a local elastic run's two names the
    ranks number their GPUs from 0 under each, so the second name's come after
    the first's."""
    if not cfg.strategy.elastic or cfg.strategy.hosts:
        return local_rank
    offset = 0
    for host, slots in local_hosts(cfg.strategy.num_workers):
        if host == os.environ.get("HOROVOD_HOSTNAME"):
            break
        offset += slots
    return offset + local_rank


class HorovodDistribution(Distribution):
    """A rank: averages its gradients with the others' (DistributedGradientTape),
    starts from rank 0's variables, reads its own shard of the data."""

    def __init__(self, cfg, run_dir):
        import horovod.tensorflow as hvd

        super().__init__(cfg, run_dir)
        hvd.init()
        self.hvd = hvd
        self.is_chief = hvd.rank() == 0
        self.images_per_update = images_per_update(cfg)
        self.updates_per_call = updates_per_call(cfg)
        self.shard = {}

    def processes_on_host(self) -> int:
        # A local elastic run's ranks are all on this machine, under two names.
        if self.cfg.strategy.elastic and not self.cfg.strategy.hosts:
            return self.cfg.strategy.num_workers
        return self.hvd.local_size()

    def gpu(self) -> int | None:
        if not self.cfg.strategy.gpus_per_worker:
            return None
        return gpu_index(self.cfg, self.hvd.local_rank())

    def prepare(self, trainer) -> None:
        import tensorflow as tf

        hvd = self.hvd
        compression = (
            hvd.Compression.fp16 if self.cfg.strategy.fp16_allreduce else hvd.Compression.none
        )
        self.trainer = trainer

        def wrap(tape):
            return hvd.DistributedGradientTape(tape, compression=compression)

        @tf.function
        def train_steps(batches):
            for _ in tf.range(self.updates_per_call):
                trainer.step(*next(batches), wrap)

        self.train_steps = train_steps
        if not self.cfg.strategy.elastic:
            hvd.broadcast_variables(trainer.model.variables, root_rank=0)
            self.reshard()

    def reshard(self) -> None:
        """This rank's share of the data. An elastic run keeps the global batch
        (and so the learning rate) for any number of ranks, leaving out the
        remainder of a batch they do not divide."""
        from distrepro.training.inputs import make_dataset

        cfg, rank, size = self.cfg, self.hvd.rank(), self.hvd.size()
        per_rank = cfg.train.global_batch_size // size
        self.shard["train"] = iter(make_dataset(cfg.data, "train", per_rank, rank, size, cfg.seed))
        self.shard["validation"] = make_dataset(cfg.data, "validation", per_rank, rank, size)

    def run_updates(self, count: int) -> None:
        for _ in range(count // self.updates_per_call):
            self.train_steps(self.shard["train"])

    def count_correct(self):
        return self.hvd.allreduce(
            self.trainer.count_correct(self.shard["validation"]), op=self.hvd.Sum
        )

    def workers(self) -> int:
        return self.hvd.size()

    def params(self, device: str) -> dict:
        mine = f"rank {self.hvd.rank()} on {socket.gethostname()}: {device}"
        # An elastic run's ranks may not all be there: each says only its own.
        devices = [mine] if self.cfg.strategy.elastic else self.hvd.allgather_object(mine)
        return {"ranks": self.hvd.size(), "devices": "; ".join(devices)}

    def profile(self, files):
        from distrepro.training.files import HOROVOD_TIMELINE, PROFILE_DIR, Profile

        timeline = str(files.run_dir / PROFILE_DIR / HOROVOD_TIMELINE)
        start_timeline = lambda seconds: self.hvd.start_timeline(timeline)  # noqa: E731
        return Profile(
            self.cfg, files, start_timeline, self.hvd.stop_timeline, self.updates_per_call
        )

    def train(self, train, track, files) -> list[dict]:
        if not self.cfg.strategy.elastic:
            return super().train(train, track, files)
        return self.train_elastic(train, track, files)

    def train_elastic(self, train, track, files) -> list[dict]:
        """Train as ranks come and go. After a failure the ranks left restore
        their last commit; when a host rejoins, the next commit stops every rank.
        Either way they start again from the commit, resharded for their number
        (the global batch, and so the learning rate, stays as configured)."""
        from distrepro.training.loop import Progress

        hvd, trainer = self.hvd, self.trainer
        trainer.optimizer.build(trainer.model.trainable_variables)
        optimizer_variables = trainer.optimizer.variables
        if callable(optimizer_variables):  # LossScaleOptimizer's is a method
            optimizer_variables = optimizer_variables()
        variables = trainer.model.variables + list(optimizer_variables)
        state = ElasticState(variables, **vars(Progress(files.restore())))

        @hvd.elastic.run
        def train_from(state: ElasticState) -> list[dict]:
            self.is_chief = files.is_chief = hvd.rank() == 0
            track()
            self.reshard()
            return train(state, self.cfg.strategy.commit_every)

        return train_from(state)


if __name__ == "__main__":
    take_gloo_slot()
    main(sys.argv[1], HorovodDistribution)
