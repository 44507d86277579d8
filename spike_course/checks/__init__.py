"""Friendly checks for the exercises: compare a learner's answer with a reference and,
when it is wrong, say which mistake it most likely is.

Every check raises :class:`CheckFailed` (an AssertionError) with a message that names
the likely mistake and how to fix it, and prints one "passed" line when all is well.
One module per chapter's exercises; everything is importable from
``spike_course.checks`` directly.
"""

from __future__ import annotations

# Re-exports: every name below is part of the package's API.
# ruff: noqa: F401

from ._common import CheckFailed, close, launch_reports, passed
from .ch08_communication import check_dgx_prediction, check_two_level_allreduce
from .ch03_data_parallel import check_distributed_accuracy, check_flat_allreduce
from .ch09_federated import check_fedavg
from .ch07_launching import check_resharded_resume
from .ch01_message_passing import check_all_to_all, check_tree_allreduce
from .ch04_pipeline import check_gpipe_schedule, check_pipeline_gradients
from .ch04_pipeline_training import check_pipeline_training
from .ch02_sampling import check_sampler
from .ch05_tensor_parallel import check_tp_plan, check_vocab_parallel_embedding
from .ch06_zero import check_fsdp2_checkpoint, check_zero1
from .ch17_capstone import check_capstone_job, check_capstone_submit
from .ch10_profiling import check_hang_diagnosis, check_straggler
from .ch11_memory import check_fits_budget, check_peak_prediction
from .ch12_context_parallel import check_ring_attention
from .ch12_expert_parallel import check_moe_layer
from .ch13_sizing import check_job_plan
from .ch14_preemption import check_preemption_safe
from .ch15_training_through_failures import check_corruption_guard, check_straggler_watch
from .ch16_async_tp import check_matmul_reduce_scatter
from .ch16_compile_ready import check_compile_ready_block
from .ch16_fp8 import check_fp8_operands
from .ch16_large_jobs import check_sharded_blocks
from .ch16_zero_bubble import check_zero_bubble_order

# Guarded against code in the notebook (see _guard): each check verifies that nothing it
# relies on was replaced since this import, and this package refuses new values.
import sys as _sys

from . import _guard
from ._guard import Tampering

for _name in [name for name in dir() if name.startswith("check_")]:
    globals()[_name] = _guard.guarded(globals()[_name])
_guard.take_snapshot()
_sys.modules[__name__].__class__ = _guard.SealedModule
