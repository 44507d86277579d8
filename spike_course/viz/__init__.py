"""Matplotlib figures for the course. Every function returns the Figure it drew, so a
notebook shows it and a test can inspect it; none calls ``plt.show()``.

One module per topic: message_passing (message timelines, all-reduce cost curves),
sampling (sampler index maps, per-rank curves), data_parallel (DDP buckets), pipeline
(schedule Gantt charts), memory (ZeRO bars, measured vs model), communication
(bandwidth curves, step times, strategy bars), federated (site classes, FedAvg curves).
Everything is importable from ``spike_course.viz`` directly.
"""

from __future__ import annotations

# Re-exports: every name below is part of the package's API.
# ruff: noqa: F401

from .communication import bandwidth_curves, step_time_curves, strategy_bars
from .data_parallel import ddp_buckets
from .federated import site_classes, federated_curves
from .memory import (
    MEMORY_KINDS,
    MEMORY_COLORS,
    WITH_ACTIVATIONS,
    zero_memory_bars,
    memory_measured_vs_model,
)
from .message_passing import message_timeline, allreduce_cost_curves
from .pipeline import PHASE_COLORS, pipeline_gantt
from .sampling import sampler_index_map, rank_curves
