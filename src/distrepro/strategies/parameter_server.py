"""TensorFlow's parameter-server training: ps and worker tasks are
`tf.distribute.Server`s in processes of their own; the coordinator
(ParameterServerStrategy + ClusterCoordinator) schedules asynchronous steps
on the workers. A dead worker task is started again on its address and the
coordinator reruns its lost steps; a dead ps task ends the attempt.

The launcher starts the tasks, on this machine, on `strategy.hosts` over
ssh, or as steps of a SLURM job on its nodes (each task a step named after
it: "worker:1"), and gives them the cluster in DISTREPRO_CLUSTER. Under TF_CONFIG (a
cluster whose hosts each start their own task) the launcher is the chief and
starts only the coordinator.

    python -m distrepro.strategies.parameter_server task JOB INDEX THREADS
    python -m distrepro.strategies.parameter_server task          (under TF_CONFIG)
    python -m distrepro.strategies.parameter_server coordinator CONFIG
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from distrepro import hosts
from distrepro.config import ConfigError
from distrepro.devices import devices_of_tasks, host_gpus
from distrepro.processes import Restarts, free_ports, process_env, start, stop
from distrepro.training.distribution import Distribution, main

MODULE = "distrepro.strategies.parameter_server"
KEYS = ("num_ps", "ps_placement", "partitioner")
PLACEMENTS = ("separate", "colocated")
PARTITIONERS = ("none", "min_size", "fixed")  # TensorFlow's MinSize- and FixedShardsPartitioner
EXCHANGE = "parameter server"
BACKWARD_OVERLAP = 0.0  # a worker sends its gradients after its backward pass


def validate(cfg: DictConfig) -> None:
    """strategy.num_ps, and under TF_CONFIG a launcher that is the cluster's
    chief (the coordinator); its other tasks run `parameter_server task` on
    their hosts."""
    strategy = cfg.strategy
    if strategy.num_ps < 1:
        raise ConfigError(f"strategy.num_ps={strategy.num_ps} must be at least 1")
    if strategy.ps_placement not in PLACEMENTS:
        raise ConfigError(
            f"strategy.ps_placement={strategy.ps_placement} must be one of {', '.join(PLACEMENTS)}"
        )
    beside = len(worker_hosts(cfg))
    if strategy.ps_placement == "colocated" and strategy.num_ps not in (1, beside):
        raise ConfigError(
            f"strategy.num_ps={strategy.num_ps}: strategy.ps_placement=colocated puts one ps task "
            f"beside each worker's host, {beside} here"
        )
    if strategy.partitioner not in PARTITIONERS:
        raise ConfigError(
            f"strategy.partitioner={strategy.partitioner} must be one of {', '.join(PARTITIONERS)}"
        )
    if "TF_CONFIG" not in os.environ:
        return
    task = json.loads(os.environ["TF_CONFIG"]).get("task", {})
    if task.get("type") != "chief":
        raise ConfigError(
            f"TF_CONFIG names this process {task.get('type')}:{task.get('index')}: the launcher "
            f"is the chief; start `python -m {MODULE} task` for the others"
        )


def worker_hosts(cfg: DictConfig) -> list[str]:
    """The hosts of the workers, in order (127.0.0.1 without hosts)."""
    machines = hosts.of_run(cfg) or [("127.0.0.1", cfg.strategy.num_workers)]
    return [host for host, slots in machines if slots]


def ps_tasks(cfg: DictConfig) -> int:
    """strategy.num_ps, or colocated, one beside each worker's host."""
    if cfg.strategy.ps_placement == "colocated":
        return len(worker_hosts(cfg))
    return cfg.strategy.num_ps


def processes(cfg: DictConfig) -> int:
    return cfg.strategy.num_workers + ps_tasks(cfg) + 1  # and the coordinator


def images_per_update(cfg: DictConfig) -> int:
    """Asynchronous: each worker's update is one batch of its own."""
    return cfg.train.global_batch_size // cfg.strategy.num_workers


def updates_per_call(cfg: DictConfig) -> int:
    return cfg.strategy.steps_per_call


def describe(cfg: DictConfig) -> str:
    return f"{ps_tasks(cfg)} ps + {cfg.strategy.num_workers} workers + 1 coordinator"


def supervise(
    coordinator: subprocess.Popen, tasks: dict, restart, restarts: Restarts
) -> str | None:
    """Wait for the coordinator; return why it failed, or None. A dead worker
    task is started again on its address (TF's coordinator reruns its lost
    steps); a dead ps task ends the attempt, as TF cannot recover from it."""
    while coordinator.poll() is None:
        for name, proc in list(tasks.items()):
            if proc.poll() is None:
                continue
            cause = f"task {name} (pid {proc.pid}) exited with {proc.returncode}"
            if not name.startswith("worker"):
                return cause
            restarts.record(cause)
            tasks[name] = restart(name)
        time.sleep(0.2)
    code = coordinator.returncode
    return f"the coordinator exited with {code}" if code else None


def placement(cfg: DictConfig) -> dict[str, str]:
    """The host of each task ("worker:0", "ps:0"): the workers by the hosts'
    slots; the ps tasks on the first host, with the coordinator
    (strategy.ps_placement=separate: a host of their own when it has no
    worker slot), or one beside each worker's host (colocated); all on
    127.0.0.1 without hosts."""
    n = cfg.strategy.num_workers
    machines = hosts.of_run(cfg) or [("127.0.0.1", n)]
    workers = [host for host, slots in machines for _ in range(slots)]
    if cfg.strategy.ps_placement == "colocated":
        ps = worker_hosts(cfg)
    else:
        ps = [machines[0][0]] * cfg.strategy.num_ps
    return {f"worker:{i}": workers[i] for i in range(n)} | {f"ps:{i}": h for i, h in enumerate(ps)}


def host_shares(cfg: DictConfig, task_shares: dict[str, float] | None = None) -> tuple:
    """The model's share held beside each worker host, in the workers' order,
    for the cost model: ps tasks colocated with the workers, holding
    task_shares ("ps:0": 0.5; even when not measured). () for ps tasks on a
    host of their own."""
    if cfg.strategy.ps_placement != "colocated":
        return ()
    placed, m = placement(cfg), ps_tasks(cfg)
    task_shares = task_shares or {f"ps:{i}": 1 / m for i in range(m)}
    beside = [placed[f"worker:{i}"] for i in range(cfg.strategy.num_workers)]
    return tuple(sum(s for task, s in task_shares.items() if placed[task] == h) for h in beside)


def run(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    """Run the cluster once; return why it failed, or None. Under a TF_CONFIG
    naming this process the chief, the tasks are already running on their
    hosts: only the coordinator starts."""
    coordinator_cmd = [sys.executable, "-m", MODULE, "coordinator", str(config_path)]
    if "TF_CONFIG" in os.environ:
        coordinator = start(coordinator_cmd, process_env(cfg))
        try:
            return supervise(coordinator, {}, None, restarts)
        finally:
            stop([coordinator])
    placed = placement(cfg)
    ports = dict(zip([*placed, "chief"], free_ports(len(placed) + 1), strict=True))
    cluster = {
        job: [f"{placed[name]}:{ports[name]}" for name in placed if name.startswith(job)]
        for job in ("worker", "ps")
    }
    cluster["chief"] = [f"{coordinator_host(cfg)}:{ports['chief']}"]
    devices = devices_of_tasks(placed, cfg.strategy.gpus_per_worker, host_gpus())
    env = {
        **process_env(cfg),
        "DISTREPRO_CLUSTER": json.dumps(cluster),
        "DISTREPRO_DEVICES": json.dumps(devices),
    }

    def start_task(name: str) -> subprocess.Popen:
        job, index = name.split(":")
        sharing = sum(host == placed[name] for host in placed.values())  # and the coordinator
        threads = str(max(1, (os.cpu_count() or 1) // (sharing + 1)))
        server = [sys.executable, "-m", MODULE, "task", job, index, threads]
        task_env = {**env, **devices.get(name, {})}
        return start(hosts.command_on(placed[name], server, task_env, name), task_env)

    tasks: dict[str, subprocess.Popen] = {}
    coordinator = None
    try:
        for name in placed:
            tasks[name] = start_task(name)
        coordinator = start(coordinator_cmd, {**env, **devices.get("coordinator", {})})
        return supervise(coordinator, tasks, start_task, restarts)
    finally:
        stop([*tasks.values(), *([coordinator] if coordinator else [])])


def task_main(job: str, index: int, threads: int) -> None:
    """A ps or worker task: serves until the launcher stops it."""
    import tensorflow as tf

    cluster = cluster_resolver().cluster_spec()
    for gpu in tf.config.list_physical_devices("GPU"):  # those CUDA_VISIBLE_DEVICES gives
        tf.config.experimental.set_memory_growth(gpu, True)
    # One inter-op thread more than the share, as in training.runtime.set_threads.
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads + 1
    )
    server = tf.distribute.Server(
        cluster, job_name=job, task_index=index, protocol="grpc", config=config, start=True
    )
    server.join()


def coordinator_host(cfg: DictConfig) -> str:
    """Where the tasks reach the coordinator, which runs beside the launcher:
    the first of the run's hosts that is this machine, else its host name.
    (Left out of the cluster, TF would name it localhost, which a ps task
    on another host cannot reach when it saves a checkpoint.)"""
    machines = hosts.of_run(cfg)
    if not machines:
        return "127.0.0.1"
    return next((host for host, _ in machines if hosts.is_local(host)), socket.gethostname())


def cluster_resolver():
    import tensorflow as tf

    if "TF_CONFIG" in os.environ:
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = tf.train.ClusterSpec(json.loads(os.environ["DISTREPRO_CLUSTER"]))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc"
    )


def partitioner(cfg: DictConfig):
    """TensorFlow's variable partitioner of strategy.partitioner, as its
    ParameterServerStrategy guide sets it up: min_size splits a variable of
    more than 256 KiB along its first axis, into at most one shard per ps
    task; fixed splits every variable into one shard per ps task (fewer
    where the first axis is shorter)."""
    import tensorflow as tf

    partitioners, shards = tf.distribute.experimental.partitioners, ps_tasks(cfg)
    if cfg.strategy.partitioner == "min_size":
        return partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=shards)
    if cfg.strategy.partitioner == "fixed":
        return partitioners.FixedShardsPartitioner(num_shards=shards)
    return None


def ps_shares(variables) -> dict[str, float]:
    """Each ps task's share of the model's bytes ("ps:0"), as its variables
    and their shards were placed."""
    import tensorflow as tf

    held: dict[str, float] = {}
    for variable in variables:
        for part in getattr(variable, "variables", [variable]):  # a ShardedVariable's shards
            spec = tf.DeviceSpec.from_string(part.device)
            task = f"{spec.job}:{spec.task}"
            held[task] = held.get(task, 0.0) + part.shape.num_elements() * part.dtype.size
    total = sum(held.values())
    return {task: held[task] / total for task in sorted(held)}


def task_devices() -> str:
    """The GPUs the launcher gave each task (CUDA_VISIBLE_DEVICES), for the record."""
    if "TF_CONFIG" in os.environ:
        return "as each host started its tasks (TF_CONFIG)"
    assigned = json.loads(os.environ.get("DISTREPRO_DEVICES") or "{}")
    if not assigned:
        return "cpu (no GPU on this host)"
    gpus = {task: env["CUDA_VISIBLE_DEVICES"] for task, env in assigned.items()}
    return "; ".join(f"{task}: GPU {ids}" if ids else f"{task}: cpu" for task, ids in gpus.items())


def task_hosts(cluster_spec) -> str:
    """Where each task runs, as the task itself says: a file read on its device
    (its host name), and the coordinator's own."""
    import tensorflow as tf

    where = []
    for job in ("worker", "ps"):
        for index in range(cluster_spec.num_tasks(job)):
            with tf.device(f"/job:{job}/replica:0/task:{index}/device:CPU:0"):
                name = tf.io.read_file("/proc/sys/kernel/hostname")
            where.append(f"{job}:{index} on {name.numpy().decode().strip()}")
    return "; ".join([*where, f"coordinator on {socket.gethostname()}"])


class Coordinator(Distribution):
    """The coordinator (the chief): builds the variables on the ps tasks and
    schedules calls of strategy.steps_per_call asynchronous updates on the
    workers (ClusterCoordinator), each worker reading its own shards."""

    def __init__(self, cfg, run_dir):
        super().__init__(cfg, run_dir)
        self.images_per_update = images_per_update(cfg)
        self.updates_per_call = updates_per_call(cfg)
        self.tracing = []  # threads taking the workers' trace, joined at the end
        self.calls = []  # the scheduled calls since updates_by_worker last counted them

    def processes_on_host(self) -> int:
        return processes(self.cfg)

    def connect(self) -> None:
        import tensorflow as tf

        self.resolver = cluster_resolver()
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(
            self.resolver, variable_partitioner=partitioner(self.cfg)
        )
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)

    def scope(self):
        return self.strategy.scope()

    def prepare(self, trainer) -> None:
        import tensorflow as tf

        from distrepro.training.inputs import make_dataset

        cfg, strategy, per_worker = self.cfg, self.strategy, self.images_per_update

        def dataset_fn(context: tf.distribute.InputContext):
            # The context is the same on every worker (one pipeline in sync):
            # each worker's own shards come from its index, as TF's guide shards.
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            workers = cfg.strategy.num_workers
            batches = make_dataset(cfg.data, "train", per_worker, worker, workers, cfg.seed)
            return batches.map(lambda images, labels: (images, labels, worker))  # whose batch

        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(dataset_fn)

        batches = iter(self.coordinator.create_per_worker_dataset(per_worker_dataset_fn))
        self.val_batches = make_dataset(cfg.data, "validation", per_worker)
        self.trainer, self.batches = trainer, batches

        @tf.function
        def train_steps(iterator):
            worker = tf.constant(-1, tf.int64)
            for _ in tf.range(self.updates_per_call):
                images, labels, worker = next(iterator)
                strategy.run(trainer.step, args=(images, labels))
            return worker

        self.train_steps = train_steps

    def run_updates(self, count: int) -> None:
        calls = [
            self.coordinator.schedule(self.train_steps, args=(self.batches,))
            for _ in range(-(-count // self.updates_per_call))
        ]
        self.coordinator.join()
        self.calls += calls

    def updates_by_worker(self) -> list[int]:
        """Each worker's updates since the last call: a call ran on the worker
        whose batches it read."""
        counts = [0] * self.cfg.strategy.num_workers
        for call in self.calls:
            counts[int(call.fetch())] += self.updates_per_call
        self.calls = []
        return counts

    def count_correct(self):
        return self.trainer.count_correct(self.val_batches)

    def params(self, device: str) -> dict:
        shares = self.figures()["ps_shares"]
        return {
            "steps_per_call": self.updates_per_call,
            "devices": task_devices(),
            "hosts": task_hosts(self.resolver.cluster_spec()),
            **{f"ps_share.{task}": f"{share:.4f}" for task, share in shares.items()},
        }

    def figures(self) -> dict:
        return {"num_ps": ps_tasks(self.cfg), "ps_shares": ps_shares(self.trainer.model.variables)}

    def profile(self, files):
        """The profiled window (in whole calls): the coordinator's trace, and the
        worker tasks', whose gRPC servers serve TensorFlow's profiler. The
        workers' trace goes on after the window while training does; end()
        joins it before the run finishes."""
        import threading

        import tensorflow as tf

        from distrepro.training.files import PROFILE_DIR, WORKER_TRACES, Profile

        workers = self.resolver.cluster_spec().job_tasks("worker")
        addresses = ",".join(f"grpc://{address}" for address in workers)
        folder = str(files.run_dir / PROFILE_DIR / WORKER_TRACES)

        def trace(milliseconds: int) -> None:
            try:
                tf.profiler.experimental.client.trace(addresses, folder, milliseconds)
            except tf.errors.OpError as error:  # the run goes on without the workers' trace
                print(f"profile: no trace of the workers: {error.message}", flush=True)

        def start(seconds: float) -> None:
            # Three times the window, at least 2 s: the calls run ahead of the
            # coordinator, and only those that start and end within the trace count.
            milliseconds = max(2000, int(3000 * seconds))
            self.tracing.append(threading.Thread(target=trace, args=(milliseconds,)))
            self.tracing[0].start()

        return Profile(self.cfg, files, start, multiple=self.updates_per_call)

    def end(self) -> None:
        for thread in self.tracing:
            thread.join()  # the workers' trace, which finish() reads


if __name__ == "__main__":
    if sys.argv[1:] == ["task"]:  # a host's task under TF_CONFIG
        resolver = cluster_resolver()
        task_main(resolver.task_type, resolver.task_id, os.cpu_count() or 1)
    elif sys.argv[1] == "task":
        task_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main(sys.argv[2], Coordinator)
