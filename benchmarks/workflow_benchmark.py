"""Workflow overhead, against `snakemake --version` (the bare start of
Snakemake) in the same invocation: `snakemake -n reproduce` (the DAG alone),
`snakemake reproduce` with everything up to date, and a dry run of a
100-point sweep. With --against REV, `snakemake -n reproduce` of this commit
and of REV side by side: each in a clean git worktree with its own code,
alternating, the median of --repeat runs each.

    python benchmarks/workflow_benchmark.py   # after `snakemake --cores all reproduce`
    python benchmarks/workflow_benchmark.py --against ab3c77c --repeat 9
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
SWEEP_100 = "sweep=train.global_batch_size=range(8,808,8) strategy=horovod"


def seconds(args: list[str], expect: str, cwd: Path = REPO) -> float:
    """Wall time of one snakemake call in cwd (with cwd's own code), checked
    by a regex on its output."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(cwd / "src"),
    }
    start = time.perf_counter()
    out = subprocess.run([SNAKEMAKE, *args], cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if out.returncode or not re.search(expect, out.stdout + out.stderr, re.M):
        raise SystemExit(f"snakemake {args} did not say {expect!r}:\n{out.stdout}\n{out.stderr}")
    return elapsed


def side_by_side(revisions: dict[str, str], repeat: int) -> dict[str, float]:
    """Median seconds of `snakemake -n reproduce` in a worktree of each revision."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for name, revision in revisions.items():
            trees[name] = Path(tmp) / name
            git = ["git", "worktree", "add", "--detach", str(trees[name]), revision]
            subprocess.run(git, cwd=REPO, check=True, capture_output=True)
        try:
            times: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(repeat):
                for name, tree in trees.items():
                    times[name].append(seconds(["-n", "reproduce"], r"^train\s+\d+$", tree))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a commit to time `snakemake -n reproduce` of beside")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    reference = seconds(["--version"], r"\d")
    up_to_date = seconds(["--cores", "all", "reproduce"], "Nothing to be done")
    sweep = seconds(["-n", "sweep", "--config", SWEEP_100, "seeds=1"], r"^train\s+100$")
    result = {
        "snakemake_version_s": round(reference, 2),
        "reproduce_up_to_date_s": round(up_to_date, 2),
        "sweep_100_dry_run_s": round(sweep, 2),
        "reproduce_over_reference": round(up_to_date / reference, 2),
        "sweep_over_reference": round(sweep / reference, 2),
    }
    if args.against:
        revisions = {"this": "HEAD", args.against: args.against}
        medians = side_by_side(revisions, args.repeat)
        result["dry_run_reproduce_median_s"] = medians
        result["dry_run_reproduce_this_over_against"] = round(
            medians["this"] / medians[args.against], 2
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
