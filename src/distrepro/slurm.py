"""Inside a SLURM job: its nodes, and commands started on them as job steps
(`srun`), not over ssh, which many clusters do not allow between compute
nodes.

The launcher already runs in a step of the job (Snakemake's jobstep executor
starts each rule with `srun -n1`; so does a user's `srun python -m
distrepro.launch`). A step started from inside it needs `--overlap`, to share
that step's CPUs and memory, and none of its SLURM_* settings (one task, one
node), which srun would take as its own options; only the job's identity
stays, by which srun finds the allocation."""

from __future__ import annotations

import functools
import os
import subprocess

JOB_IDENTITY = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME")


def job_nodes(environ=os.environ) -> tuple[str, ...]:
    """The nodes of the SLURM job this process runs in; () outside one."""
    job = environ.get("SLURM_JOB_ID")
    return nodes_of_job(job) if job else ()


@functools.cache
def nodes_of_job(job: str) -> tuple[str, ...]:
    """Asked of SLURM: in a step started by `srun -n1` from a cleared
    environment (Snakemake's jobstep executor) SLURM_JOB_NODELIST names the
    step's one node, not the job's."""
    listed = ask(["squeue", "--noheader", "--jobs", job, "--format=%N"])
    return tuple(ask(["scontrol", "show", "hostnames", listed]).split())


def ask(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def nodes_for(strategy) -> int:
    """The nodes strategy.workers_per_node spreads the workers over (1 unset)."""
    return -(-strategy.num_workers // (strategy.workers_per_node or strategy.num_workers))


def in_job_of_several_nodes(environ=os.environ) -> bool:
    return len(job_nodes(environ)) > 1


def step(
    placed: list[tuple[str, int]], command: list[str], name: str, mpi: str | None = None
) -> list[str]:
    """command as one step of this job: `slots` tasks on each (node, slots) of
    placed, named `name` (squeue --steps shows it; scancel JOB.STEP stops it),
    over PMIx with mpi="pmix". A task that fails ends the step."""
    inherited = sorted(
        variable
        for variable in os.environ
        if variable.startswith(("SLURM_", "SRUN_", "SBATCH_")) and variable not in JOB_IDENTITY
    )
    srun = [
        "srun",
        "--overlap",
        f"--job-name={name}",
        f"--nodelist={','.join(node for node, _ in placed)}",
        f"--nodes={len(placed)}",
        f"--ntasks={sum(slots for _, slots in placed)}",
        f"--ntasks-per-node={max(slots for _, slots in placed)}",
        "--kill-on-bad-exit=1",
        *([f"--mpi={mpi}"] if mpi else []),
    ]
    return ["env", *(f"--unset={variable}" for variable in inherited), *srun, *command]
