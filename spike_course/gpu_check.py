"""``spike-course gpu-check [NAME...]``: run lectures and solutions on this machine and tabulate
what their ranks actually used.

Meant for a CUDA node (a DGX, or a Run:ai job with a GPU or a fraction of one): each notebook
runs headless from start to end, as a learner's "Run all" would, and on past a failing cell,
so that a row names every cell that failed, not only the first. Every rank that calls
``runtime.setup`` adds a line to a log this command names (backend, device, GPU, float32
precision), so each row says what the ranks of that notebook used, not what the machine
might offer. With two GPUs or more, each notebook runs twice (``--placement auto``): with
every GPU visible, where its ranks get a GPU each (``per-gpu``), and with one GPU visible,
which its ranks share (``shared``, as under a Run:ai GPU fraction). On a machine without a
GPU the same run shows the command works end to end and says plainly that it is no evidence
about GPUs. Not part of ``make test``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from unittest import mock

SOURCES = ("notebooks", "solutions")
PLACEMENTS = ("auto", "per-gpu", "shared")


def placements(choice: str, gpus: int) -> list[str]:
    """The runs ``--placement choice`` makes of each notebook on a machine with ``gpus`` GPUs:
    ``per-gpu`` (every GPU visible: a rank per GPU where there are enough), ``shared`` (one
    GPU visible: the ranks share it), or ``cpu`` where there is no GPU to place ranks on."""
    if choice not in PLACEMENTS:
        raise ValueError(f"--placement {choice}: choose one of {', '.join(PLACEMENTS)}")
    if gpus == 0:
        return ["cpu"]
    if gpus == 1:
        if choice == "per-gpu":
            raise ValueError("--placement per-gpu needs 2 GPUs or more: with one, the ranks can only share it")
        return ["shared"]
    return ["per-gpu", "shared"] if choice == "auto" else [choice]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def placement_env(placement: str) -> dict:
    """The environment a run with this placement adds: for ``shared``, only the first GPU
    of those visible now (CUDA_VISIBLE_DEVICES, or all of them when it is unset)."""
    if placement != "shared":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    return {"CUDA_VISIBLE_DEVICES": visible.split(",")[0].strip()}


def execute(path, timeout: int = 600, placement: str = "cpu") -> dict:
    """Run one notebook in its own folder, on past failing cells; return seconds, every
    failing cell and what its ranks used (read from their own log lines)."""
    from .lab.headless import failing_cells, run_notebook
    from .protocol import PLACEMENT_LOG_ENV, read_lines

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="spike-course-gpu-check-") as folder:
        log = Path(folder) / "placement.jsonl"
        env = {PLACEMENT_LOG_ENV: str(log), **placement_env(placement)}
        with mock.patch.dict(os.environ, env):  # the kernel, its ranks and torchruns inherit it
            run = run_notebook(path, timeout, allow_errors=True)
        ranks = read_lines(log)
    failures = failing_cells(run.notebook) + ([run.error] if run.error else [])  # run.error: it stopped
    return {"notebook": f"{path.parent.name}/{path.name}", "placement": placement, "seconds": run.seconds,
            "ok": not failures, "failures": failures, **summarize(ranks)}


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


def result(row) -> str:
    """pass, or FAIL and every failing cell (the first one first: later ones may follow from it)."""
    return "pass" if row["ok"] else "FAIL " + "; ".join(row["failures"])


def table(rows, machine: str) -> str:
    columns = ("notebook", "placement", "ranks", "backend", "device", "gpu", "precision", "seconds", "result")
    lines = [f"machine: {machine}"]
    if not is_gpu_evidence(rows):
        lines.append("NOT GPU EVIDENCE: no rank of this run computed on a GPU; it shows only that "
                     "the notebooks and this command run end to end.")
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (row["notebook"], row["placement"], row["ranks"], row["backend"], row["device"], row["gpu"],
                 row["precision"], f"{row['seconds']:.1f}", result(row))
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    passed = sum(row["ok"] for row in rows)
    lines.append(f"{passed} passed, {len(rows) - passed} failed. placement: per-gpu, every GPU visible "
                 "(a rank per GPU where there are enough); shared, one GPU visible, which the ranks share. "
                 "ranks: how many ranks called runtime.setup over the notebook's launches; 0 and '-': none "
                 "did (the capstone's scripts import nothing of the course, some exercises run in one "
                 "process). A failing cell after the first may only follow from it.")
    return "\n".join(lines)
