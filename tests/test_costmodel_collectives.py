"""Alpha-beta all-reduce times and nccl-tests bus bandwidth (spike_course.costmodel, chapter 01)."""

import math

import numpy as np
import pytest

from spike_course import costmodel, widgets
from spike_course.costmodel import (NVLINK5_BIDIR, PCIE5_X16_BIDIR, algorithm_bandwidth,
                                    allreduce_time, bus_bandwidth)


def test_link_speeds():
    assert NVLINK5_BIDIR == 1800e9 and PCIE5_X16_BIDIR == 128e9


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_allreduce_formulas(n):
    a, b, m = 2e-6, 1e-11, 1e8
    assert allreduce_time(m, n, "naive", a, b) == pytest.approx(2 * (n - 1) * (a + m * b))
    assert allreduce_time(m, n, "ring", a, b) == pytest.approx(2 * (n - 1) * (a + m / n * b))
    assert allreduce_time(m, n, "tree", a, b) == pytest.approx(
        2 * math.ceil(math.log2(n)) * (a + m * b))


def test_one_rank_costs_nothing():
    assert {allreduce_time(1e9, 1, alg, 1e-6, 1e-9) for alg in ("naive", "ring", "tree")} == {0}


def test_ring_wins_for_large_messages_tree_for_small_ones():
    a, b = 5e-6, 1 / (NVLINK5_BIDIR / 2)
    big = {alg: allreduce_time(1e9, 64, alg, a, b) for alg in ("naive", "ring", "tree")}
    small = {alg: allreduce_time(1e3, 64, alg, a, b) for alg in ("naive", "ring", "tree")}
    assert min(big, key=big.get) == "ring" and min(small, key=small.get) == "tree"
    # the ring's time hardly grows with N for large messages; naive's grows linearly
    assert allreduce_time(1e9, 64, "ring", 0, b) < 2 * allreduce_time(1e9, 2, "ring", 0, b)
    assert allreduce_time(1e9, 64, "naive", 0, b) == pytest.approx(
        63 * allreduce_time(1e9, 2, "naive", 0, b))


def test_sizes_may_be_an_array():
    sizes = np.array([1e3, 1e6])
    np.testing.assert_allclose(allreduce_time(sizes, 4, "ring", 1e-6, 1e-9),
                               [allreduce_time(s, 4, "ring", 1e-6, 1e-9) for s in sizes])


def test_unknown_algorithm_and_bad_world_size():
    with pytest.raises(ValueError, match="naive, ring, tree"):
        allreduce_time(1, 2, "butterfly", 1, 1)
    with pytest.raises(ValueError, match="world_size"):
        allreduce_time(1, 0, "ring", 1, 1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bus_bandwidth_factors_of_nccl_tests(n):
    algbw = algorithm_bandwidth(1e9, 0.5)
    assert algbw == 2e9
    assert bus_bandwidth(1e9, 0.5, n, "all_reduce") == pytest.approx(algbw * 2 * (n - 1) / n)
    assert bus_bandwidth(1e9, 0.5, n, "all_gather") == pytest.approx(algbw * (n - 1) / n)
    assert bus_bandwidth(1e9, 0.5, n, "reduce_scatter") == pytest.approx(algbw * (n - 1) / n)
    assert bus_bandwidth(1e9, 0.5, n, "broadcast") == pytest.approx(algbw)
    with pytest.raises(ValueError, match="all_reduce"):
        bus_bandwidth(1e9, 0.5, n, "allreduce")


def test_ring_bus_bandwidth_approaches_the_link_speed():
    # With no latency, a ring all-reduce's bus bandwidth is exactly the link bandwidth.
    bw = PCIE5_X16_BIDIR / 2
    for n in (2, 8, 64):
        seconds = allreduce_time(1e9, n, "ring", 0.0, 1 / bw)
        assert bus_bandwidth(1e9, seconds, n) == pytest.approx(bw)


def test_explorer_draws_at_once_and_reports_every_algorithm():
    box = widgets.allreduce_explorer(nbytes=1e6, world_size=4)
    text = box.children[2].value
    assert all(name in text for name in costmodel.ALLREDUCE_ALGORITHMS) and "ms" in text
    ranks = box.children[0].children[1]
    ranks.value = 16  # redraws without error
    assert box.children[2].value != text
