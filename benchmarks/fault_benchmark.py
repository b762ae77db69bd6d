"""What one lost worker costs each strategy, all in one invocation.

For each strategy the same digits run twice: clean, and with one worker
(a parameter-server worker task, or a Horovod rank) killed with SIGKILL
halfway through the third epoch (timed by the second, which has no tracing).
The parameter server restarts the task and goes on; Horovod (not elastic)
restarts the job from its last checkpoint; elastic Horovod goes on with the
rank left and takes the other back after its cool-down. Reports the wall time
lost and both final top-1s.

    python benchmarks/fault_benchmark.py [--epochs 5] [--settings parameter_server ...]

Needs data/tfrecords/digits (`dvc repro`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from distrepro.strategies import REGISTRY

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {name: [f"strategy={name}"] for name in REGISTRY}
SETTINGS["horovod_elastic"] = ["strategy=horovod", "strategy.elastic=true"]


def is_victim(strategy: str, cmdline: list[str]) -> bool:
    """A worker of the strategy: a process of its module that is neither a
    parameter-server ps task nor the coordinator."""
    module = cmdline[2] if cmdline[1:2] == ["-m"] else ""
    role = cmdline[3:5]
    return module == REGISTRY[strategy] and role != ["task", "ps"] and "coordinator" not in role


def victim(strategy: str, launcher: subprocess.Popen) -> psutil.Process:
    """Of the processes this launcher started, the one to kill."""
    processes = psutil.Process(launcher.pid).children(recursive=True)
    found = [p for p in processes if is_victim(strategy, p.cmdline())]
    return max(found, key=lambda p: p.pid)  # the newest: the last rank started


def run(setting: str, epochs: int, out: Path, kill: bool) -> dict:
    overrides = [*SETTINGS[setting], f"train.epochs={epochs}", f"results_dir={out}"]
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "distrepro.launch", *overrides], cwd=REPO)
    if kill:
        while not list(out.glob("*/checkpoints/ckpt-2.index")):
            time.sleep(0.05)
        (history,) = out.glob("*/history.json")
        time.sleep(json.loads(history.read_text())[1]["epoch_time_s"] / 2)
        victim(setting.removesuffix("_elastic"), proc).kill()
    if proc.wait() != 0:
        raise SystemExit(f"the {setting} run (kill={kill}) failed")
    (metrics,) = out.glob("*/metrics.json")
    return {"wall_s": time.monotonic() - start, "top1": json.loads(metrics.read_text())["top1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        for setting in args.settings:
            clean = run(setting, args.epochs, Path(tmp) / f"{setting}-clean", kill=False)
            killed = run(setting, args.epochs, Path(tmp) / f"{setting}-killed", kill=True)
            result[setting] = {
                "clean_wall_s": round(clean["wall_s"], 1),
                "killed_wall_s": round(killed["wall_s"], 1),
                "wall_s_lost": round(killed["wall_s"] - clean["wall_s"], 1),
                "clean_top1": round(clean["top1"], 4),
                "killed_top1": round(killed["top1"], 4),
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
