"""``spike-course gpu-check``: run every lecture and solution on this machine and tabulate.

Meant for a CUDA node (a DGX, or a Run:ai job with GPUs): each notebook runs headless
from start to end, as a learner's "Run all" would, and one row says which backend its
workers used, how long it took, and the first cell that failed. On a machine without a
GPU it runs the same notebooks on the CPU, which shows the command works end to end but
proves nothing about GPUs; the table says which it was. Not part of ``make test``.
"""

from __future__ import annotations

from pathlib import Path

SOURCES = ("notebooks", "solutions")


def backend_in_use(nproc: int = 2) -> str:
    """What ``runtime.setup()`` picks for a chapter's usual ``nproc`` ranks on this machine."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= nproc:
        return f"nccl ({gpus} GPUs)"
    if gpus:
        return f"gloo, cpu ({gpus} GPU < {nproc} ranks)"
    return "gloo, cpu (no GPU)"


def execute(path, timeout: int = 600) -> dict:
    """Run one notebook in its own folder; return seconds, ok and the first failing cell."""
    from .headless import run_notebook

    path = Path(path)
    run = run_notebook(path, timeout)
    return {"notebook": f"{path.parent.name}/{path.name}", "seconds": run.seconds,
            "ok": run.error is None, "failure": run.error}


def notebooks(root, only=()) -> list[Path]:
    """Lectures, then solutions, in chapter order; ``only`` keeps names containing one of them."""
    found = [p for folder in SOURCES for p in sorted((Path(root) / folder).glob("[0-9][0-9]_*.ipynb"))]
    return [p for p in found if not only or any(key in str(p) for key in only)]


def table(rows, backend: str) -> str:
    lines = [f"{'notebook':48s} {'backend':28s} {'seconds':>8s}  result",
             f"{'-' * 48} {'-' * 28} {'-' * 8}  ------"]
    for row in rows:
        result = "pass" if row["ok"] else f"FAIL {row['failure']}"
        lines.append(f"{row['notebook']:48s} {backend:28s} {row['seconds']:8.1f}  {result}")
    passed = sum(row["ok"] for row in rows)
    lines.append(f"{passed} passed, {len(rows) - passed} failed")
    return "\n".join(lines)
