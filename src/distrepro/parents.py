"""Parent runs in MLflow: the run that a setting's seeds, or a sweep's, a
scaling's, a network or a stragglers experiment's settings, are children of.

A parent is first described: a folder holding parent.json (its experiment,
tags, name and its own parent's folder), written by the workflow or by a
Hydra multirun, without MLflow. Its first child creates it in MLflow, as
that child's run is created, so that the parent starts when its first child
does; each child's end moves its parents' ends to its own, so that a parent
spans its children in the runs table's Duration.

    python -m distrepro.parents KIND EXPERIMENT NAME FOLDER [OUTER_FOLDER]
"""

from __future__ import annotations

import fcntl
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from distrepro.atomic import write_json_atomically

SPEC, RUN_ID = "parent.json", "run_id"


def describe(folder: Path, experiment: str, kind: str, name: str, outer: Path | None = None):
    """A parent tagged kind=name in experiment, itself a child of outer's."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"experiment": experiment, "kind": kind, "name": name, "outer": outer and str(outer)}
    write_json_atomically(folder / SPEC, spec)


@contextmanager
def locked(path: Path):
    """An exclusive lock on path (created), across processes and hosts that
    share the filesystem."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_id(folder: Path) -> str:
    """The parent's MLflow run, created by the first child that asks."""
    id_file = folder / RUN_ID
    with locked(folder / ".lock"):
        if not id_file.exists():
            from distrepro.tracking import create_parent

            spec = json.loads((folder / SPEC).read_text())
            outer = run_id(Path(spec["outer"])) if spec["outer"] else None
            tags = {spec["kind"]: spec["name"]}
            id_file.write_text(create_parent(spec["experiment"], spec["name"], tags, outer))
    return id_file.read_text().strip()


def extend(folder: Path, end_ms: int) -> None:
    """The parent, and its own parents, end no earlier than end_ms."""
    from distrepro.tracking import end_no_earlier

    spec = json.loads((folder / SPEC).read_text())
    end_no_earlier(run_id(folder), end_ms)
    if spec["outer"]:
        extend(Path(spec["outer"]), end_ms)


def main(argv: list[str]) -> None:
    if len(argv) not in (4, 5):
        raise SystemExit("usage: python -m distrepro.parents KIND EXPERIMENT NAME FOLDER [OUTER]")
    kind, experiment, name, folder, *outer = argv
    describe(Path(folder), experiment, kind, name, Path(outer[0]) if outer else None)


if __name__ == "__main__":
    main(sys.argv[1:])
