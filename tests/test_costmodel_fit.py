"""costmodel's chapter 08 part: fitting alpha and beta, and the predictions built on them."""

import numpy as np
import pytest

from spike_course import costmodel

SIZES = np.logspace(0, 8, 17)  # 1 byte to 100 MB, as a benchmark measures them


def test_fit_recovers_exact_line():
    alpha, beta = 20e-6, 1 / 5e9
    a, b = costmodel.fit_alpha_beta(SIZES, alpha + beta * SIZES)
    assert a == pytest.approx(alpha, rel=1e-6)
    assert b == pytest.approx(beta, rel=1e-6)


def test_fit_with_noise_recovers_both_values():
    rng = np.random.default_rng(0)
    alpha, beta = 50e-6, 1 / 2e9
    seconds = (alpha + beta * SIZES) * rng.uniform(0.9, 1.1, SIZES.size)
    a, b = costmodel.fit_alpha_beta(SIZES, seconds)
    assert a == pytest.approx(alpha, rel=0.15)
    assert b == pytest.approx(beta, rel=0.15)


def test_relative_weights_keep_alpha_where_a_plain_fit_loses_it():
    rng = np.random.default_rng(1)
    alpha, beta = 10e-6, 1 / 10e9
    seconds = (alpha + beta * SIZES) * rng.uniform(0.95, 1.05, SIZES.size)
    relative, _ = costmodel.fit_alpha_beta(SIZES, seconds)
    plain, _ = costmodel.fit_alpha_beta(SIZES, seconds, relative=False)
    assert relative == pytest.approx(alpha, rel=0.2)
    assert abs(plain - alpha) > 5 * abs(relative - alpha)  # the big messages drown alpha


def test_fit_never_returns_a_negative_latency():
    # times that grow faster than linearly would want a negative intercept
    sizes = np.array([1e3, 1e4, 1e5, 1e6])
    a, b = costmodel.fit_alpha_beta(sizes, 1e-9 * sizes ** 1.2)
    assert a == 0.0 and b > 0


@pytest.mark.parametrize("seconds", [[4e-3, 3e-3, 2e-3, 1e-3], [2.0e-3, 2.2e-3, 1.9e-3, 1.8e-3]])
def test_times_that_do_not_grow_with_the_size_give_no_bandwidth(seconds):
    # a busy machine: every call waits for the scheduler, whatever its size (beta would be <= 0)
    with pytest.raises(ValueError, match="do not grow with the message size"):
        costmodel.fit_alpha_beta([1e3, 1e4, 1e5, 1e6], seconds)


@pytest.mark.parametrize("sizes, seconds", [([1, 2], [1e-3]), ([1], [1e-3]), ([1, 2], [1e-3, 0.0]),
                                            ([-1, 2], [1e-3, 2e-3])])
def test_fit_rejects_bad_input(sizes, seconds):
    with pytest.raises(ValueError):
        costmodel.fit_alpha_beta(sizes, seconds)


def test_links_are_one_direction_of_the_published_figures():
    assert costmodel.link_bandwidth("nvlink5") == costmodel.NVLINK5_BIDIR / 2 == 900e9
    assert costmodel.link_bandwidth("pcie5") == costmodel.PCIE5_X16_BIDIR / 2 == 64e9
    with pytest.raises(ValueError, match="unknown link"):
        costmodel.link_bandwidth("nvlink4")


@pytest.mark.parametrize("n", [2, 3, 8])
def test_collective_time_agrees_with_the_ring_allreduce_of_chapter_01(n):
    alpha, bw, nbytes = 3e-6, 64e9, 123e6
    ours = costmodel.collective_time("all_reduce", nbytes, n, bw, alpha)
    assert ours == pytest.approx(costmodel.allreduce_time(nbytes, n, "ring", alpha, 1 / bw))
    # all_gather and reduce_scatter are each half of it
    half = costmodel.collective_time("all_gather", nbytes, n, bw, alpha)
    assert 2 * half == pytest.approx(ours)
    assert costmodel.collective_time("reduce_scatter", nbytes, n, bw, alpha) == pytest.approx(half)
    assert costmodel.collective_time("all_reduce", nbytes, 1, bw, alpha) == 0.0


def test_dp_buckets_pay_one_latency_each():
    bw, n = 900e9, 8
    assert costmodel.GRAD_BYTES == 4  # float32 gradients: what DDP all-reduces without a compression hook
    one = costmodel.collective_time("all_reduce", 4e9, n, bw)
    bucketed = costmodel.dp_comm_time(1e9, n, bw)  # 4 GB of float32 gradients in 25 MiB buckets
    buckets = int(np.ceil(4e9 / costmodel.DDP_BUCKET_BYTES))
    assert bucketed == pytest.approx(one + (buckets - 1) * 2 * (n - 1) * costmodel.NCCL_ALPHA)


def test_fsdp_moves_one_and_a_half_times_ddp_elements():
    bw = costmodel.link_bandwidth("nvlink5")
    same_dtype = costmodel.fsdp_comm_time(7e9, 8, bw, param_bytes=4, grad_bytes=4, alpha=0)
    assert same_dtype / costmodel.dp_comm_time(7e9, 8, bw, alpha=0) == pytest.approx(1.5)
    # bf16 gathers and float32 reductions (the defaults): 2 + 2 + 4 bytes against DDP's 2 x 4
    mixed = costmodel.fsdp_comm_time(7e9, 8, bw, alpha=0)
    assert mixed / costmodel.dp_comm_time(7e9, 8, bw, alpha=0) == pytest.approx(1.0)


def test_group_bandwidth_inside_a_node_is_nvlink():
    assert costmodel.group_bandwidth(8) == costmodel.link_bandwidth("nvlink5")
    assert costmodel.group_bandwidth(4, link="pcie5") == costmodel.link_bandwidth("pcie5")


def test_group_bandwidth_over_whole_nodes_uses_every_nic():
    # a DGX B200: 8 NICs of 50 GB/s, one per rail; a ring over whole nodes spreads its bytes over all
    assert (costmodel.GPUS_PER_NODE, costmodel.NICS_PER_NODE) == (8, 8)
    assert costmodel.IB_NDR_PER_NIC == costmodel.link_bandwidth("ib_ndr") == 50e9
    assert costmodel.group_bandwidth(16) == costmodel.group_bandwidth(512) == 8 * 50e9
    assert costmodel.group_bandwidth(16, nics_per_node=1) == 50e9          # one NIC for the node
    assert costmodel.group_bandwidth(16, nics_per_node=32) == 900e9        # NVLink is the limit then


def test_group_bandwidth_shares_the_nics_with_the_nodes_other_groups():
    assert costmodel.group_bandwidth(8, ranks_per_node=1) == 50e9   # GPU i of 8 nodes: rail i only
    assert costmodel.group_bandwidth(8, ranks_per_node=4) == 200e9  # half the node: half its NICs
    assert costmodel.group_bandwidth(1, ranks_per_node=1) == 900e9  # a group of one never leaves its GPU


@pytest.mark.parametrize("kwargs", [{"world_size": 0}, {"world_size": 16, "ranks_per_node": 9},
                                    {"world_size": 16, "ranks_per_node": 0}, {"world_size": 2.0}])
def test_group_bandwidth_rejects_impossible_groups(kwargs):
    with pytest.raises(ValueError):
        costmodel.group_bandwidth(**kwargs)


def test_nvlink_beats_pcie_by_the_ratio_of_the_links():
    nv, pcie = costmodel.link_bandwidth("nvlink5"), costmodel.link_bandwidth("pcie5")
    ratio = costmodel.dp_comm_time(7e9, 8, pcie, alpha=0) / costmodel.dp_comm_time(7e9, 8, nv, alpha=0)
    assert ratio == pytest.approx(1800 / 128)


def test_tp_traffic_scales_with_tokens_and_layers_not_parameters():
    bw = costmodel.link_bandwidth("nvlink5")
    one = costmodel.tp_comm_time(1024, 4096, 32, 8, bw, alpha=0)
    assert costmodel.tp_comm_time(2048, 4096, 32, 8, bw, alpha=0) == pytest.approx(2 * one)
    assert costmodel.tp_comm_time(1024, 4096, 64, 8, bw, alpha=0) == pytest.approx(2 * one)


def test_compute_time_is_six_flops_per_parameter_and_token():
    assert costmodel.compute_time(1e9, 1000, flops=1e15, mfu=0.5) == pytest.approx(6e12 / 5e14)


def test_transformer_shape_looks_like_llama():
    layers, hidden = costmodel.transformer_shape(7e9)
    assert 28 <= layers <= 36 and 3584 <= hidden <= 4608 and hidden % 128 == 0


def recommended(rows):
    return [r["strategy"] for r in rows if r["recommended"]]


def test_plan_small_model_uses_ddp():
    assert recommended(costmodel.plan_parallelism(1e9, 16384, 8)) == ["DDP"]


def test_plan_shards_what_ddp_cannot_hold():
    rows = costmodel.plan_parallelism(30e9, 16384, 8)
    assert not next(r for r in rows if r["strategy"] == "DDP")["fits"]
    assert recommended(rows) == ["FSDP"]


def test_plan_prefers_hsdp_across_nodes():
    assert recommended(costmodel.plan_parallelism(30e9, 16384, 64)) == ["HSDP"]


def test_plan_counts_the_nics_of_a_node():
    def comm(**kw):
        return {r["strategy"]: r["comm"] for r in costmodel.plan_parallelism(7e9, 16384, 64, **kw)}

    rails, one = comm(), comm(nics_per_node=1)
    # DDP and FSDP over whole nodes: 8 NICs carry 8 times as much; latency is the same
    assert rails["DDP"] < one["DDP"] and rails["FSDP"] < one["FSDP"]
    no_latency = {n: costmodel.dp_comm_time(7e9, 64, costmodel.group_bandwidth(64, nics_per_node=n), alpha=0)
                  for n in (1, 8)}
    assert no_latency[1] == pytest.approx(8 * no_latency[8])


def test_plan_says_when_nothing_fits():
    rows = costmodel.plan_parallelism(70e9, 16384, 8)
    assert recommended(rows) == []
    assert "nothing fits" in costmodel.recommend(rows)


def test_plan_warns_against_tensor_parallel_over_pcie():
    rows = costmodel.plan_parallelism(7e9, 16384, 8, link="pcie5")
    tp = next(r for r in rows if r["strategy"].startswith("TP"))
    assert "PCIe" in tp["why"] and tp["comm"] > tp["compute"]
