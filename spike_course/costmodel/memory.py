"""Closed-form costs for chapter 06: fully sharded data parallel (memory per device, ZeRO paper)."""

from __future__ import annotations



ZERO_STAGES = (0, 1, 2, 3)


def zero_memory_breakdown(num_params: float, dp_size: int, stage: int, k: float = 12, *,
                          param_bytes: float = 2, grad_bytes: float = 2) -> dict:
    """Bytes per device of parameters, gradients and optimizer state under ZeRO ``stage``.

    Rajbhandari et al. (2019), section 3 and figure 1: with mixed-precision Adam a model
    of Psi parameters holds 2 Psi bytes of fp16/bf16 parameters, 2 Psi of gradients and
    K Psi of optimizer state (K = 12: fp32 master weights, momentum and variance).
    Stage 1 shards the optimizer state over the ``dp_size`` = N_d data-parallel ranks,
    stage 2 also the gradients, stage 3 also the parameters; stage 0 is plain data
    parallel. ``param_bytes``/``grad_bytes``/``k`` let the same formulas describe other
    precisions, e.g. fp32 Adam without a master copy: 4, 4 and k=8.
    Activations and temporary buffers are not counted (the paper's "residual states").
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size!r}")
    n = dp_size
    return {
        "parameters": param_bytes * num_params / (n if stage >= 3 else 1),
        "gradients": grad_bytes * num_params / (n if stage >= 2 else 1),
        "optimizer": k * num_params / (n if stage >= 1 else 1),
    }


def zero_memory(num_params: float, dp_size: int, stage: int, k: float = 12, *,
                param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per device for model states under ZeRO ``stage`` (0-3), the paper's formulas:

    stage 0: (2 + 2 + K) Psi            stage 1: 4 Psi + K Psi / N_d
    stage 2: 2 Psi + (2 + K) Psi / N_d  stage 3: (2 + 2 + K) Psi / N_d

    e.g. Psi = 7.5e9, N_d = 64, K = 12 gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.
    """
    return sum(zero_memory_breakdown(num_params, dp_size, stage, k,
                                     param_bytes=param_bytes, grad_bytes=grad_bytes).values())
