"""Figures for chapter 04: pipeline schedules."""

from __future__ import annotations

import matplotlib.pyplot as plt

from ..costmodel.pipeline import as_event

PHASE_COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
PHASE_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def pipeline_gantt(events, ax=None, title: str | None = None, unit: str = "s",
                   scale: float = 1.0, label: bool = True):
    """Gantt chart of a pipeline step: one row per rank, one box per micro-batch's
    forward (blue) or backward (orange), numbered by micro-batch; white space is idle. A
    backward split in two (chapter 16) draws its input gradient red and its weight gradient green.

    ``events``: dicts ``{"rank", "microbatch", "phase", "start", "end"}`` (or tuples in
    that order), measured by a worker or made by
    :func:`spike_course.costmodel.pipeline_schedule`. An optional ``"stage"`` key (an
    interleaved schedule runs several stages per rank) draws later stages hatched.
    Times are shifted so the step starts at 0 and multiplied by ``scale`` (e.g. 1e3 with
    ``unit="ms"``). Pass ``ax`` to draw into an existing subplot; returns the Figure.
    """
    events = [as_event(e) for e in events]
    if ax is None:
        ranks = len({e["rank"] for e in events}) or 1
        fig, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * ranks))
    fig = ax.figure
    if not events:
        return fig
    t0 = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    n_ranks = len(ranks)
    for e in events:
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        row = ranks.index(e["rank"])
        hatch = "//" if e.get("stage", e["rank"]) >= n_ranks else None
        ax.barh(row, width, left=start, height=0.8, color=PHASE_COLORS.get(e["phase"], "tab:gray"),
                edgecolor="black", linewidth=0.5, hatch=hatch)
        if label:
            ax.text(start + width / 2, row, str(e["microbatch"]), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    phases = [p for p in PHASE_NAMES if p in {e["phase"] for e in events}]
    handles = [plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS[p]) for p in phases]
    ax.legend(handles, [PHASE_NAMES[p] for p in phases], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
