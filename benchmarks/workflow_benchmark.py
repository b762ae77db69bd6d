"""Workflow overhead: `snakemake reproduce` with everything up to date, and a
dry run of a 100-point sweep, against `snakemake --version` (the bare start
of Snakemake) in the same invocation.

    python benchmarks/workflow_benchmark.py     # after `snakemake --cores all reproduce`
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
SWEEP_100 = "sweep=train.global_batch_size=range(8,808,8) strategy=horovod"


def seconds(args: list[str], expect: str) -> float:
    """Wall time of one snakemake call, checked by a regex on its output."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    start = time.perf_counter()
    out = subprocess.run([SNAKEMAKE, *args], cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if out.returncode or not re.search(expect, out.stdout + out.stderr, re.M):
        raise SystemExit(f"snakemake {args} did not say {expect!r}:\n{out.stdout}\n{out.stderr}")
    return elapsed


def main() -> None:
    reference = seconds(["--version"], r"\d")
    up_to_date = seconds(["--cores", "all", "reproduce"], "Nothing to be done")
    sweep = seconds(["-n", "sweep", "--config", SWEEP_100], r"^train\s+100$")
    result = {
        "snakemake_version_s": round(reference, 2),
        "reproduce_up_to_date_s": round(up_to_date, 2),
        "sweep_100_dry_run_s": round(sweep, 2),
        "reproduce_over_reference": round(up_to_date / reference, 2),
        "sweep_over_reference": round(sweep / reference, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
