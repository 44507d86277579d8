"""The all-reduces built on the simulator (tests/reference_collectives.py): right sums, the
traffic each algorithm is known for, and costmodel.allreduce_time's times exactly."""

import numpy as np
import pytest
import torch

from reference_collectives import naive_allreduce, ring_allreduce, tree_allreduce
from spike_course.costmodel import allreduce_time
from spike_course.mpi_sim import World


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("allreduce", [naive_allreduce, ring_allreduce, tree_allreduce])
def test_reference_allreduces_sum(n, allreduce):
    inputs = [np.arange(2 * n + 5, dtype=float) * (r + 1) for r in range(n)]
    results = World(n).run(lambda comm: allreduce(comm, inputs[comm.rank]))
    for got in results:
        np.testing.assert_allclose(got, np.sum(inputs, axis=0))


def test_ring_allreduce_on_tensors_keeps_shape_and_input():
    inputs = [torch.full((3, 4), float(r)) for r in range(3)]
    results = World(3).run(lambda comm: ring_allreduce(comm, inputs[comm.rank]))
    for got in results:
        torch.testing.assert_close(got, torch.full((3, 4), 3.0))
    assert torch.equal(inputs[1], torch.full((3, 4), 1.0))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_sends_2_n_minus_1_over_n_of_the_bytes_per_rank(n):
    array_bytes = 8 * 96 * n  # float64, a length that n divides
    world = World(n, eager_limit=0)  # no buffering: the ring must still not deadlock
    world.run(lambda comm: ring_allreduce(comm, np.ones(96 * n)))
    assert world.messages_per_rank() == [2 * (n - 1)] * n
    assert world.bytes_per_rank() == [2 * (n - 1) * array_bytes // n] * n
    assert all(m.dest == (m.source + 1) % n for m in world.trace)


def test_naive_puts_all_traffic_on_rank_0():
    n, array_bytes = 5, 8 * 1000
    world = World(n)
    world.run(lambda comm: naive_allreduce(comm, np.ones(1000)))
    assert world.bytes_per_rank() == [(n - 1) * array_bytes] + [array_bytes] * (n - 1)


@pytest.mark.parametrize("algorithm,fn", [("naive", naive_allreduce), ("ring", ring_allreduce),
                                          ("tree", tree_allreduce)])
@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_simulated_times_match_the_cost_model(algorithm, fn, n):
    alpha, beta, length = 3e-6, 1e-10, 64 * 840  # 840 is divisible by 2..8
    world = World(n, alpha=alpha, beta=beta)
    world.run(lambda comm: fn(comm, np.ones(length)))
    assert world.elapsed == pytest.approx(allreduce_time(8 * length, n, algorithm, alpha, beta))
