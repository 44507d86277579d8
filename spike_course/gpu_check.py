"""``spike-course gpu-check [NAME...]``: run lectures and solutions on this machine and tabulate
what their ranks actually used.

Meant for a CUDA node (a DGX, or a Run:ai job with a GPU or a fraction of one): each notebook
runs headless from start to end, as a learner's "Run all" would. Every rank that calls
``runtime.setup`` adds a line to a log this command names (backend, device, GPU, float32
precision), so each row says what the ranks of that notebook used, not what the machine
might offer. On a machine without a GPU the same run shows the command works end to end
and says plainly that it is no evidence about GPUs. Not part of ``make test``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from unittest import mock

SOURCES = ("notebooks", "solutions")


def execute(path, timeout: int = 600) -> dict:
    """Run one notebook in its own folder; return seconds, ok, the first failing cell and
    what its ranks used (read from their own log lines)."""
    from .headless import run_notebook
    from .protocol import PLACEMENT_LOG_ENV, read_lines

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="spike-course-gpu-check-") as folder:
        log = Path(folder) / "placement.jsonl"
        with mock.patch.dict(os.environ, {PLACEMENT_LOG_ENV: str(log)}):  # the kernel, its
            run = run_notebook(path, timeout)                            # ranks and torchruns inherit it
        ranks = read_lines(log)
    return {"notebook": f"{path.parent.name}/{path.name}", "seconds": run.seconds,
            "ok": run.error is None, "failure": run.error, **summarize(ranks)}


def summarize(ranks: list[dict]) -> dict:
    """What a notebook's ranks used, over all its launches: backends, devices, GPUs, precision."""
    def joined(key):
        return ", ".join(sorted({str(r[key]) for r in ranks if r.get(key) is not None})) or "-"

    shared = any(r["shares_gpu"] for r in ranks)
    return {"ranks": len(ranks), "backend": joined("backend"),
            "device": joined("device") + (" (shared)" if shared else ""),
            "gpu": joined("gpu"), "precision": joined("precision")}


def notebooks(root, only=()) -> list[Path]:
    """Lectures, then solutions, in chapter order; ``only`` keeps paths containing one of them
    (``03``, ``05_tensor``, ``solutions/11``)."""
    found = [p for folder in SOURCES for p in sorted((Path(root) / folder).glob("[0-9][0-9]_*.ipynb"))]
    return [p for p in found if not only or any(key in str(p) for key in only)]


def is_gpu_evidence(rows) -> bool:
    """True when some rank of the run computed on a CUDA device."""
    return any("cuda" in row["device"] for row in rows)


def table(rows, machine: str) -> str:
    columns = ("notebook", "ranks", "backend", "device", "gpu", "precision", "seconds", "result")
    lines = [f"machine: {machine}"]
    if not is_gpu_evidence(rows):
        lines.append("NOT GPU EVIDENCE: no rank of this run computed on a GPU; it shows only that "
                     "the notebooks and this command run end to end.")
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        result = "pass" if row["ok"] else f"FAIL {row['failure']}"
        cells = (row["notebook"], row["ranks"], row["backend"], row["device"], row["gpu"],
                 row["precision"], f"{row['seconds']:.1f}", result)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    passed = sum(row["ok"] for row in rows)
    lines.append(f"{passed} passed, {len(rows) - passed} failed. ranks: how many ranks called "
                 "runtime.setup over the notebook's launches; 0 and '-': none did (the capstone's "
                 "scripts import nothing of the course, some exercises run in one process).")
    return "\n".join(lines)
