"""Per-rank progress while a launch runs: workers write it, the notebook shows it.

A worker calls ``spike_course.runtime.progress(step, total)``; that writes a tiny JSON
file into the launch's results folder (``protocol.write_progress``). While ranks run,
``launch`` calls ``ProgressView.refresh()``, which reads those files and moves one
progress bar per rank (ipywidgets) in JupyterLab. Outside a Jupyter kernel, or when no rank reports progress,
nothing is shown: the ranks' own printed lines are the plain-text fallback.
"""

from __future__ import annotations

import time

from ..protocol import read_progress


def _in_jupyter_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class ProgressView:
    """One ipywidgets progress bar per rank, created when the first rank reports."""

    def __init__(self, nproc: int, results_dir, enabled: bool = True, every: float = 0.3):
        self.nproc = nproc
        self.results_dir = results_dir
        self.enabled = enabled and _in_jupyter_kernel()
        self.every = every
        self._last = 0.0
        self._bars = None
        self._box = None

    def refresh(self, force: bool = False) -> None:
        if not self.enabled or (not force and time.monotonic() - self._last < self.every):
            return
        self._last = time.monotonic()
        reports = read_progress(self.results_dir)
        if not reports:
            return
        if self._bars is None:
            self._build()
        for rank, report in reports.items():
            bar = self._bars.get(rank)
            if bar is None:
                continue
            bar.max = max(1, int(report["total"]))
            bar.value = min(int(report["step"]), bar.max)
            bar.description = f"rank {rank}"
            bar.bar_style = "success" if bar.value >= bar.max else ""
            self._notes[rank].value = f"{bar.value}/{bar.max} {report.get('note', '')}"

    def _build(self) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        self._bars = {r: widgets.IntProgress(value=0, min=0, max=1, description=f"rank {r}")
                      for r in range(self.nproc)}
        self._notes = {r: widgets.Label("waiting") for r in range(self.nproc)}
        rows = [widgets.HBox([self._bars[r], self._notes[r]]) for r in range(self.nproc)]
        self._box = widgets.VBox(rows)
        self._box.add_class("spike-course-progress")
        display(self._box)

    def close(self) -> None:
        # Show the final state (a finished run ends with full bars).
        self.refresh(force=True)
