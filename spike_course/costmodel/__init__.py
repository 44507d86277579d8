"""Closed-form costs, so that measurements have something to be compared with.

One module per topic: collectives (alpha-beta collective times, bus bandwidth as
nccl-tests defines it, link speeds, a group's bandwidth across nodes, fitting alpha and
beta), pipeline (bubble fraction, ideal schedules), memory (ZeRO/FSDP bytes per device,
activations, the memory planner), planner (step-time predictions, the parallelism
decision guide). Pure python and numpy: no torch.
Everything is importable from ``spike_course.costmodel`` directly.
"""

from __future__ import annotations

# Re-exports: every name below is part of the package's API.
# ruff: noqa: F401

from .collectives import (
    NVLINK5_BIDIR,
    PCIE5_X16_BIDIR,
    IB_NDR_PER_NIC,
    GPUS_PER_NODE,
    NICS_PER_NODE,
    NCCL_ALPHA,
    ALLREDUCE_ALGORITHMS,
    BUS_FACTORS,
    allreduce_time,
    algorithm_bandwidth,
    bus_bandwidth,
    fit_alpha_beta,
    link_bandwidth,
    collective_time,
    group_bandwidth,
)
from .planner import (
    B200_BF16_FLOPS,
    DDP_BUCKET_BYTES,
    ACTIVATION_HEADROOM,
    GRAD_BYTES,
    dp_comm_time,
    fsdp_comm_time,
    tp_comm_time,
    compute_time,
    transformer_shape,
    plan_parallelism,
    recommend,
)
from .memory import (
    ZERO_STAGES,
    zero_memory_breakdown,
    zero_memory,
    PRECISIONS,
    MODEL_SHAPES,
    B200_MEMORY,
    USABLE,
    transformer_params,
    activation_bytes,
    memory_plan,
    fit_suggestions,
)
from .pipeline import (
    PIPELINE_SCHEDULES,
    pipeline_bubble,
    pipeline_schedule,
    pipeline_idle_fraction,
    pipeline_peak_activations,
    PipelineDeadlock,
    simulate_pipeline,
)
