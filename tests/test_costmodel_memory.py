"""The ZeRO memory formulas of spike_course.costmodel (chapter 06)."""

import pytest

from spike_course.costmodel import zero_memory, zero_memory_breakdown


def test_paper_example_7_5B_on_64_ranks():
    # Rajbhandari et al. (2019), figure 1: Psi = 7.5B, N_d = 64, K = 12.
    gb = [zero_memory(7.5e9, 64, stage) / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


@pytest.mark.parametrize("psi,n,k", [(1e6, 4, 12), (3e9, 8, 12), (1000, 3, 8)])
def test_formulas_stage_by_stage(psi, n, k):
    assert zero_memory(psi, n, 0, k) == pytest.approx((2 + 2 + k) * psi)
    assert zero_memory(psi, n, 1, k) == pytest.approx(4 * psi + k * psi / n)
    assert zero_memory(psi, n, 2, k) == pytest.approx(2 * psi + (2 + k) * psi / n)
    assert zero_memory(psi, n, 3, k) == pytest.approx((2 + 2 + k) * psi / n)


def test_default_k_is_mixed_precision_adam_16_bytes_per_param():
    assert zero_memory(1, 1, 0) == 16


def test_one_rank_shards_nothing():
    assert {zero_memory(5e6, 1, stage) for stage in range(4)} == {zero_memory(5e6, 1, 0)}


def test_each_stage_saves_memory():
    per_stage = [zero_memory(1e9, 16, stage) for stage in range(4)]
    assert per_stage == sorted(per_stage, reverse=True) and len(set(per_stage)) == 4


def test_breakdown_fp32_adam():
    # fp32 parameters and gradients, Adam momentum + variance (no master copy): K = 8.
    parts = zero_memory_breakdown(1000, 4, 3, k=8, param_bytes=4, grad_bytes=4)
    assert parts == {"parameters": 1000.0, "gradients": 1000.0, "optimizer": 2000.0}
    parts = zero_memory_breakdown(1000, 4, 1, k=8, param_bytes=4, grad_bytes=4)
    assert parts == {"parameters": 4000, "gradients": 4000, "optimizer": 2000.0}


@pytest.mark.parametrize("stage,dp", [(4, 2), (-1, 2), (1, 0)])
def test_rejects_bad_arguments(stage, dp):
    with pytest.raises(ValueError):
        zero_memory(1e6, dp, stage)
