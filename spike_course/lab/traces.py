"""Reading a rank's ``torch.profiler`` trace (Chrome/Perfetto format) as intervals on the
machine's clock, and how much of one kind of interval another kind covered: chapter 10
builds these steps in its notebook ("How much communication did backward hide?"); chapter
16's lecture and its check read its traces with them. Standard library only."""

from __future__ import annotations

import json
from pathlib import Path


def load_trace(path) -> list[dict]:
    """A trace's complete events (``"ph": "X"``): name, thread, start and end in microseconds,
    counted from the trace's ``baseTimeNanoseconds`` so that several ranks share one clock."""
    trace = json.loads(Path(path).read_text())
    base = trace["baseTimeNanoseconds"] / 1000
    return [{"name": e["name"], "tid": e["tid"], "start": base + e["ts"], "end": base + e["ts"] + e["dur"]}
            for e in trace["traceEvents"] if e.get("ph") == "X"]


def spans(events, names) -> list[tuple[float, float]]:
    """(start, end) of the events whose name starts with one of ``names``."""
    return [(e["start"], e["end"]) for e in events if e["name"].startswith(tuple(names))]


def union(intervals) -> list[list[float]]:
    """Overlapping intervals merged into disjoint ones (gloo's threads may run two at once)."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals) -> float:
    return sum(end - start for start, end in union(intervals))


def hidden_share(communication, compute) -> float:
    """The share of ``communication``'s time during which ``compute`` also ran (0 when there
    was no communication): chapter 10's |C ∩ B| / |C|."""
    c, b = union(communication), union(compute)
    both = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in c for s2, e2 in b)
    return both / length(c) if c else 0.0
