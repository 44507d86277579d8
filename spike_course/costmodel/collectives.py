"""Closed-form costs for chapter 01: message passing (alpha-beta all-reduce times, bus bandwidth)."""

from __future__ import annotations



# Link speeds as published: both directions added. One direction carries half.
NVLINK5_BIDIR = 1800e9     # bytes/s per GPU, NVLink 5 (Blackwell, e.g. B200 in a DGX)
PCIE5_X16_BIDIR = 128e9    # bytes/s, a PCIe Gen 5 x16 slot

ALLREDUCE_ALGORITHMS = ("naive", "ring", "tree")

# busbw = algbw * factor(n), as nccl-tests defines it (its doc/PERFORMANCE.md): the factor
# turns "bytes of the buffer per second" into "bytes through each rank's link per second",
# a number that can be compared with the link speed whatever the number of ranks.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def allreduce_time(nbytes, world_size: int, algorithm: str, alpha: float, beta: float):
    """Seconds to all-reduce ``nbytes`` over ``world_size`` ranks in the alpha-beta model.

    A message of n bytes costs ``alpha + n * beta`` (latency in seconds, seconds per
    byte), and a rank's link carries one message at a time in each direction:

    naive: everyone sends to rank 0, which sends the sum back: 2(N-1)(alpha + n beta),
           since rank 0's link carries all 2(N-1) whole arrays one after the other.
    ring:  reduce-scatter then all-gather, 2(N-1) steps of one n/N chunk:
           2(N-1)(alpha + n beta / N): the bandwidth term hardly grows with N.
    tree:  binomial reduce then broadcast, 2 ceil(log2 N) rounds of the whole array:
           2 ceil(log2 N)(alpha + n beta): few latencies, but full-size messages.

    ``spike_course.mpi_sim`` reproduces these times exactly with its reference
    implementations. Real libraries do better than this "tree" (NCCL pipelines a double
    binary tree in chunks) and the reduction's arithmetic is not counted. ``nbytes`` may
    be a numpy array of sizes.
    """
    import math

    n = world_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {n!r}")
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes * beta)
    if algorithm == "ring":
        return 2 * (n - 1) * (alpha + nbytes / n * beta)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose one of "
                     f"{', '.join(ALLREDUCE_ALGORITHMS)}")


def algorithm_bandwidth(nbytes, seconds):
    """algbw: bytes of the buffer divided by the time the collective took (nccl-tests)."""
    return nbytes / seconds


def bus_bandwidth(nbytes, seconds, world_size: int, op: str = "all_reduce"):
    """busbw as nccl-tests reports it: algbw times a factor of the operation and world size.

    all_reduce 2(n-1)/n; all_gather, reduce_scatter and alltoall (n-1)/n; broadcast and
    reduce 1. ``nbytes`` is the size nccl-tests prints: the whole buffer (the output of
    an all_gather, the input of a reduce_scatter).
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(BUS_FACTORS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTORS[op](world_size)
