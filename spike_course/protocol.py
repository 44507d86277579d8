"""The few names and files that the notebook's launcher and the ranks share.

``spike_course.launch`` (in the notebook) and ``spike_course.runtime`` (in every rank)
talk through environment variables and small files in a results folder. Both import this
module, which needs only the standard library: it runs on the cluster too, where the
notebook side (psutil, ipywidgets) does not exist.

Nothing here is set under a plain ``torchrun``: then ``runtime.report`` and
``runtime.progress`` do nothing, and ``runtime.setup`` keeps PyTorch's own defaults.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

# Set by launch() for every rank; their presence means "a notebook started me".
RESULTS_DIR_ENV = "SPIKE_COURSE_RESULTS_DIR"        # folder for results and progress files
PARENT_PID_ENV = "SPIKE_COURSE_PARENT_PID"          # the kernel: ranks exit when it dies
COLLECTIVE_TIMEOUT_ENV = "SPIKE_COURSE_COLLECTIVE_TIMEOUT"  # seconds a collective may wait
# Set by ``spike-course gpu-check`` only: a file every rank's setup() adds a JSON line to.
PLACEMENT_LOG_ENV = "SPIKE_COURSE_PLACEMENT_LOG"
# Set by ``data.load_mnist`` once it said it falls back to synthetic digits: the kernel's later
# loads, and the ranks it launches afterwards (they inherit it), do not say it again.
DATA_FALLBACK_SAID_ENV = "SPIKE_COURSE_DATA_FALLBACK_SAID"


def write_atomically(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never
    half of one: write a temporary file in the same folder, then rename it (atomic)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def append_line(path, record: dict) -> None:
    """Add ``record`` as one JSON line to ``path``: one write of a short line in append mode,
    so the lines of ranks writing at once do not mix."""
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")


def read_lines(path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_result(results_dir, rank: int, values: dict) -> None:
    write_atomically(Path(results_dir) / f"rank{rank}.pkl", pickle.dumps(values))


def read_results(results_dir) -> dict:
    """{rank: values} for every rank that reported."""
    results = {}
    for path in sorted(Path(results_dir).glob("rank*.pkl")):
        results[int(path.stem[len("rank"):])] = pickle.loads(path.read_bytes())
    return results


def write_progress(results_dir, rank: int, step: int, total: int, note: str = "") -> None:
    payload = json.dumps({"step": step, "total": total, "note": note}).encode()
    write_atomically(Path(results_dir) / f"progress{rank}.json", payload)


def read_progress(results_dir) -> dict:
    """{rank: {"step", "total", "note"}} for every rank that has reported so far."""
    found = {}
    for path in Path(results_dir).glob("progress*.json"):
        try:
            found[int(path.stem[len("progress"):])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # being replaced right now; the next refresh reads it
    return found
