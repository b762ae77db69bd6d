"""Where a profiled window's time went. From Horovod's timeline (Chrome trace
events, one "process" per tensor): the share of the window in which any
tensor was being allreduced, and in which any was still being negotiated
(waiting until every rank has produced it), and how spread out in a step
the gradients become ready. From TensorFlow's profiler
traces: a parameter-server worker's waiting, and the share of TensorFlow's
own all-reduce."""

from __future__ import annotations

import json
from pathlib import Path

PHASES = {"ALLREDUCE": "allreduce_share", "NEGOTIATE_ALLREDUCE": "negotiate_share"}


def read_timeline(path: Path) -> list[dict]:
    """The events; Horovod leaves the JSON array open when it stops recording."""
    text = path.read_text().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def phase_intervals(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Each tensor's top-level phases as (begin, end) in microseconds."""
    intervals: dict[str, list[tuple[float, float]]] = {name: [] for name in PHASES}
    open_events: dict[int, list[dict]] = {}
    for event in events:
        stack = open_events.setdefault(event.get("pid", -1), [])
        if event.get("ph") == "B":
            stack.append(event)
        elif event.get("ph") == "E" and stack:
            begin = stack.pop()
            if not stack and begin["name"] in intervals:
                intervals[begin["name"]].append((begin["ts"], event["ts"]))
    return intervals


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of intervals."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


def exchange_shares(path: Path) -> dict[str, float]:
    """{"allreduce_share": s, "negotiate_share": s} of the timeline's window."""
    events = [e for e in read_timeline(path) if "ts" in e]
    window = max(e["ts"] for e in events) - min(e["ts"] for e in events)
    intervals = phase_intervals(events)
    return {share: covered(intervals[phase]) / window for phase, share in PHASES.items()}


def gradients_ready_within_s(path: Path) -> float:
    """How long after a step's first gradient its last one is handed to
    Horovod (the median over the window's steps): the part of the backward
    pass an all-reduce could overlap. Each tensor is handed over once a step."""
    events = [e for e in read_timeline(path) if "ts" in e]
    ready = sorted(
        e["ts"] for e in events if e.get("name") == "NEGOTIATE_ALLREDUCE" and e.get("ph") == "B"
    )
    tensors = len({e["pid"] for e in events if e.get("name") == "NEGOTIATE_ALLREDUCE"})
    spreads = sorted(
        ready[i + tensors - 1] - ready[i] for i in range(0, len(ready) - tensors + 1, tensors)
    )
    return spreads[len(spreads) // 2] / 1e6


def xplane_events(xplane: Path):
    """(thread, event name, begin, end) of a TensorFlow profiler trace, in ps."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(xplane.read_bytes())
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                begin = line.timestamp_ns * 1000 + event.offset_ps
                name = plane.event_metadata[event.metadata_id].name
                yield line.name, name, begin, begin + event.duration_ps


STEP_FUNCTION = "KernelAndDeviceFunc::Run"


def share_of_step_functions(xplane: Path, is_part) -> float:
    """The share of the time the trace's whole step functions ran that is
    covered by events for which is_part(thread, name); nan when the trace
    holds no whole step function."""
    functions, parts = [], []
    for thread, name, begin, end in xplane_events(xplane):
        if name == STEP_FUNCTION:
            functions.append((begin, end))
        elif is_part(thread, name):
            parts.append((begin, end))
    if not functions:
        return float("nan")
    first, last = min(b for b, _ in functions), max(e for _, e in functions)
    inside = [(b, e) for b, e in parts if first <= b and e <= last]
    return min(1.0, covered(inside) / covered(functions))


def worker_wait_share(xplane: Path) -> float:
    """From a parameter-server worker's profiler trace: the share of the time
    its step functions ran in which none of its compute threads ran a kernel
    other than sending to the ps, that is, waited for variables to arrive
    from the ps tasks (or for its input, or for a core)."""

    def computing(thread: str, name: str) -> bool:
        return thread.startswith("tf_Compute") and ":" in name and "_Send" not in name

    return max(0.0, 1 - share_of_step_functions(xplane, computing))


COLLECTIVES = ("CollectiveReduce", "NcclAllReduce")


def collective_share(xplane: Path) -> float:
    """From the chief's profiler trace of TensorFlow's own all-reduce
    (MultiWorkerMirroredStrategy): the share of the time its step functions
    ran in which a gradient was being all-reduced."""
    return share_of_step_functions(
        xplane, lambda thread, name: any(op in name for op in COLLECTIVES)
    )
