"""Closed-form communication costs: alpha-beta all-reduce times (chapter 01), bus bandwidth
as nccl-tests defines it, link speeds, the bandwidth of a group across DGX nodes, fitting
alpha and beta to measurements and the time of one ring collective on a real link
(chapter 08)."""

from __future__ import annotations

# Link speeds as published: both directions added. One direction carries half.
NVLINK5_BIDIR = 1800e9     # bytes/s per GPU, NVLink 5 (Blackwell, e.g. B200 in a DGX)
PCIE5_X16_BIDIR = 128e9    # bytes/s, a PCIe Gen 5 x16 slot
IB_NDR_PER_NIC = 50e9      # bytes/s per direction of one 400 Gb/s InfiniBand NDR NIC
NCCL_ALPHA = 1e-6          # seconds of latency per ring step inside a node (8 GPUs: ~15 us a call)

# A DGX B200: 8 GPUs, and 8 such NICs for the compute network, one beside each GPU. The
# network is "rail-optimised": NIC i of every node is on switch (rail) i, so GPU i of one
# node reaches GPU i of any other through one NIC and one switch.
GPUS_PER_NODE = 8
NICS_PER_NODE = 8

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

    The simulator (``mpi_sim``) reproduces these times exactly: chapter 01 holds its ring
    and the learner's tree to them. Real libraries do better than this "tree" (NCCL
    pipelines a double binary tree in chunks) and the reduction's arithmetic is not
    counted. ``nbytes`` may be a numpy array of sizes.
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


def fit_alpha_beta(sizes, seconds, relative: bool = True) -> tuple[float, float]:
    """Fit ``seconds = alpha + beta * size`` by least squares with alpha, beta >= 0.

    ``sizes`` in bytes, ``seconds`` measured times; returns (alpha in seconds, beta in
    seconds per byte), so 1/beta is the bandwidth the line implies. With ``relative``
    (the default) each point's error counts relative to its own time: timings span
    several orders of magnitude, and a plain fit would let the biggest messages decide
    everything and leave alpha as noise (or negative). A negative alpha is not physical;
    the fit then returns the best line through the origin. Times that do not grow with
    the size give no bandwidth at all (beta would be 0 or negative): a ValueError says so.
    """
    import numpy as np

    x = np.asarray(sizes, dtype=float).ravel()
    y = np.asarray(seconds, dtype=float).ravel()
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need as many sizes as times, at least 2; got {x.size} and {y.size}")
    if np.any(x < 0) or np.any(y <= 0) or not np.all(np.isfinite(x + y)):
        raise ValueError("sizes must be >= 0 and times > 0 and finite")
    w = 1.0 / y if relative else np.ones_like(y)

    def loss(a, b):
        return float(np.sum((w * (a + b * x - y)) ** 2))

    a, b = np.linalg.lstsq(np.stack([w, w * x], axis=1), w * y, rcond=None)[0]
    if a >= 0 and b > 0:
        return float(a), float(b)
    candidates = [(float(np.sum(w**2 * y) / np.sum(w**2)), 0.0)]  # beta = 0: a constant
    if np.sum(w**2 * x**2) > 0:                                    # alpha = 0: through the origin
        candidates.append((0.0, max(0.0, float(np.sum(w**2 * x * y) / np.sum(w**2 * x**2)))))
    a, b = min(candidates, key=lambda ab: loss(*ab))
    if b == 0:  # every bandwidth computed from it would divide by zero
        raise ValueError("these times do not grow with the message size, so they give no bandwidth "
                         "(the best line through them is flat): other programs probably took the "
                         "cores while it measured. Measure again, with the machine less busy.")
    return a, b


def link_bandwidth(link: str) -> float:
    """Bytes per second in ONE direction per GPU of a named link.

    The published figures are bidirectional (both directions added); a ring collective
    sends and receives at once, so each direction carries half of it. ``"ib_ndr"`` is one
    NIC: right for one stream between two GPUs of different nodes (a pipeline's send, a ring
    attention step); a collective over whole nodes uses all their NICs at once
    (:func:`group_bandwidth`).
    """
    links = {"nvlink5": NVLINK5_BIDIR / 2, "pcie5": PCIE5_X16_BIDIR / 2, "ib_ndr": IB_NDR_PER_NIC}
    if link not in links:
        raise ValueError(f"unknown link {link!r}: choose one of {', '.join(links)}")
    return links[link]


def collective_time(op: str, nbytes: float, world_size: int, bandwidth: float,
                    alpha: float = NCCL_ALPHA) -> float:
    """Seconds of one ring collective: latency steps * alpha + bus bytes / bandwidth.

    ``nbytes`` is the size nccl-tests reports (the whole buffer); the bytes each GPU has
    to push through its link are ``nbytes`` times the bus-bandwidth factor of ``op``,
    which is why bus bandwidth is the number to compare with a link's speed.
    ``bandwidth`` is per direction (see :func:`link_bandwidth`).
    """
    n = world_size
    if n == 1:
        return 0.0
    factor = bus_bandwidth(1.0, 1.0, n, op)  # busbw/algbw, the nccl-tests factor
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * alpha + nbytes * factor / bandwidth


def group_bandwidth(world_size: int, ranks_per_node: int | None = None,
                    gpus_per_node: int = GPUS_PER_NODE, nics_per_node: int = NICS_PER_NODE,
                    link: str = "nvlink5", nic: float = IB_NDR_PER_NIC) -> float:
    """Bus bandwidth per rank (bytes/s, one direction) of a ring collective over a group.

    ``ranks_per_node`` is how many of the group's ranks share a node: by default the group is
    consecutive ranks, so it fills whole nodes (``min(world_size, gpus_per_node)``).
    Inside one node it is the node's ``link``. Across nodes, NCCL runs one ring (channel)
    per rail, each carrying its share of the bytes, and each ring leaves a node through
    one NIC: the bytes that cross the network are spread over all the node's NICs. Each
    rank's bus bandwidth is then the smaller of the link inside the node and the NICs the
    group has: about min(900 GB/s, 8 x 50 GB/s) for whole DGX B200 nodes, not 50 GB/s.
    A group with fewer ranks per node shares the NICs with the node's other groups (the
    replicas of HSDP, the dp groups of a tp x dp mesh), which run at the same time: with one
    rank per node it has one NIC, 50 GB/s.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    per_node = min(world_size, gpus_per_node) if ranks_per_node is None else ranks_per_node
    if not isinstance(per_node, int) or not 1 <= per_node <= gpus_per_node:
        raise ValueError(f"ranks_per_node must be a whole number from 1 to {gpus_per_node}, got {per_node!r}")
    inside = link_bandwidth(link)
    if world_size <= per_node:  # the whole group is in one node
        return inside
    return min(inside, nics_per_node * per_node / gpus_per_node * nic)
