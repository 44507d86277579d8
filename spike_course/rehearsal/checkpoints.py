"""The last checkpoint a rehearsed job left on its volume, and whether it loads.

A checkpoint is a file the ranks wrote (or renamed into place) whose name says so (``.pt``,
``.pth``, ``.ckpt``, ``.safetensors``), or a distributed checkpoint: a folder with a
``.metadata`` file. "Complete" means it loads: a ``torch.save`` cut by a SIGKILL does not.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".tar")


def last_checkpoint(run) -> dict | None:
    """{"path", "written" (s after the start), "by" (ranks), "loads", "error"} of the checkpoint
    last written under the run's volume, or None when the ranks wrote none."""
    written = {}
    for process in run.processes:
        for t, path in process.writes:
            target = _checkpoint_of(Path(path), run.volume)
            if target is not None:
                when, by = written.get(target, (0.0, set()))
                written[target] = (max(when, t), by | {process.rank})
    if not written:
        return None
    path, (when, by) = max(written.items(), key=lambda item: item[1][0])
    error = _load_error(path)
    return {"path": str(path.relative_to(run.volume)), "written": when - run.began,
            "by": sorted(r for r in by if r is not None), "loads": error is None, "error": error}


def _checkpoint_of(path: Path, volume: Path) -> Path | None:
    try:
        path.relative_to(volume)
    except ValueError:
        return None
    if path.name.endswith(SUFFIXES):
        return path
    if path.parent != volume and (path.parent / ".metadata").exists():
        return path.parent   # a file of a distributed checkpoint: the folder is the checkpoint
    return None


def _load_error(path: Path) -> str | None:
    import torch

    try:
        if path.is_dir():
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            with tempfile.TemporaryDirectory() as scratch:
                dcp_to_torch_save(path, Path(scratch) / "whole.pt")
                torch.load(Path(scratch) / "whole.pt", map_location="cpu", weights_only=False)
        else:
            torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # any failure to load is the finding
        return f"{type(error).__name__}: {str(error)[:200]}"
    return None
