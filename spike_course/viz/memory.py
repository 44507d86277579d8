"""Figures for chapter 06: fully sharded data parallel (memory bars)."""

from __future__ import annotations

import matplotlib.pyplot as plt



MEMORY_KINDS = ("parameters", "gradients", "optimizer")
MEMORY_COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green",
                 "activations": "tab:purple"}
WITH_ACTIVATIONS = MEMORY_KINDS + ("activations",)  # chapter 11 counts the saved activations too


def _stacked_memory_bar(ax, x, parts, scale, width=0.7, labels=True, kinds=MEMORY_KINDS, **style):
    bottom = 0.0
    for kind in kinds:
        value = parts.get(kind, 0.0) / scale
        ax.bar(x, value, width, bottom=bottom, color=MEMORY_COLORS[kind],
               label=kind if labels else None, **style)
        bottom += value
    return bottom


def zero_memory_bars(breakdowns: dict, highlight=None, capacity: float | None = None,
                     unit: str = "GB", title: str | None = None, kinds=MEMORY_KINDS):
    """Stacked bars of bytes per device, one bar per entry of ``breakdowns``.

    ``breakdowns[label]`` is a dict with "parameters", "gradients" and "optimizer" bytes
    (what ``costmodel.zero_memory_breakdown`` returns); ``highlight`` is the label to
    show solid (the others are faded), ``capacity`` (bytes) draws the memory of one
    device as a dashed line.
    """
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (label, parts) in enumerate(breakdowns.items()):
        chosen = highlight is None or label == highlight
        top = _stacked_memory_bar(ax, i, parts, scale, labels=False, kinds=kinds,
                                  alpha=1.0 if chosen else 0.35)
        ax.text(i, top, f"{top:,.3g} {unit}", ha="center", va="bottom", fontsize=9,
                fontweight="bold" if label == highlight else "normal")
    if capacity is not None:
        ax.axhline(capacity / scale, color="red", linestyle="--",
                   label=f"one device: {capacity / scale:,.0f} {unit}")
    for kind in kinds:  # legend entries in full colour, whichever bar is faded
        ax.bar(0, 0, color=MEMORY_COLORS[kind], label=kind)
    ax.set_xticks(range(len(breakdowns)), list(breakdowns))
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(title or "model states per device")
    ax.legend(loc="upper right", fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def memory_measured_vs_model(measured: dict, modeled: dict, unit: str = "KB",
                             title: str | None = None, kinds=MEMORY_KINDS):
    """Measured bytes per rank beside the cost model's, as pairs of stacked bars.

    ``measured[label]`` and ``modeled[label]`` are dicts of "parameters", "gradients" and
    "optimizer" bytes (and "activations" with ``kinds=WITH_ACTIVATIONS``); each label
    (e.g. "F = 2") gets a solid bar (measured) and a hatched one (cost model) side by side.
    """
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, label in enumerate(measured):
        _stacked_memory_bar(ax, i - 0.2, measured[label], scale, width=0.38, labels=i == 0, kinds=kinds)
        top = _stacked_memory_bar(ax, i + 0.2, modeled[label], scale, width=0.38, labels=False, kinds=kinds,
                                  hatch="//", alpha=0.55, edgecolor="black")
        ax.text(i + 0.2, top, "model", ha="center", va="bottom", fontsize=8)
        ax.text(i - 0.2, sum(measured[label].get(k, 0) for k in kinds) / scale, "measured", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(measured)), list(measured))
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title or "bytes each rank holds: measured (solid) and cost model (hatched)")
    ax.legend(loc="upper right", fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig
