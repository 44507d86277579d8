"""All-reduces built from the simulator's point-to-point messages, for the tests.

``naive_allreduce`` (everything through rank 0), ``ring_allreduce`` (reduce-scatter,
then all-gather) and ``tree_allreduce`` (binomial reduce, then broadcast). Each takes
a rank's ``comm`` and its array (numpy or torch) and returns the sum over the ranks,
shaped like the input, which it leaves untouched. Their simulated times are exactly
``costmodel.allreduce_time``'s formulas, which the tests hold them to.

They live here, not in ``spike_course``: chapter 01 defines its naive and ring all-reduce
in the lecture, and the tree is its exercise 1 (a learner must not be able to import it).
"""

from __future__ import annotations

import math

from spike_course.mpi_sim import waitall


def _flat_copy(array):
    if hasattr(array, "clone"):              # torch tensor
        return array.detach().clone().reshape(-1)
    import numpy as np
    return np.array(array, copy=True).reshape(-1)


def _split(flat, parts):
    """``parts`` nearly equal chunks that are views into ``flat`` (writes go through)."""
    if hasattr(flat, "tensor_split"):
        return list(flat.tensor_split(parts))
    import numpy as np
    return np.array_split(flat, parts)


def _shape(array):
    return tuple(array.shape)


def naive_allreduce(comm, array):
    """Everyone sends its whole array to rank 0, which sums and sends the total back.

    Rank 0's link carries 2(N-1) whole arrays, one after the other: its time grows
    linearly with the world size.
    """
    total = _flat_copy(array)
    if comm.rank == 0:
        for source in range(1, comm.size):
            total += comm.recv(source).reshape(-1)
        requests = [comm.isend(total, dest) for dest in range(1, comm.size)]
        waitall(requests)
    else:
        comm.send(total, 0)
        total = comm.recv(0)
    return total.reshape(_shape(array))


def ring_allreduce(comm, array):
    """Reduce-scatter then all-gather around the ring, one chunk per step.

    The array is cut into N chunks. In step s of the reduce-scatter, rank r sends chunk
    (r - s) mod N to its right neighbour and adds the chunk (r - s - 1) mod N it gets
    from its left one; after N-1 steps it holds the full sum of chunk (r + 1) mod N.
    The all-gather then passes the finished chunks around the ring for N-1 more steps.
    Each rank sends 2(N-1) messages of about 1/N of the array: 2(N-1)/N of its bytes,
    almost independent of N. ``isend`` before ``recv`` keeps the ring from deadlocking
    when sends are too large to be buffered.
    """
    n, r = comm.size, comm.rank
    flat = _flat_copy(array)
    chunks = _split(flat, n)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):                     # reduce-scatter
        request = comm.isend(chunks[(r - step) % n], right, tag=step)
        chunks[(r - step - 1) % n] += comm.recv(left, tag=step)
        request.wait()
    for step in range(n - 1):                     # all-gather
        request = comm.isend(chunks[(r - step + 1) % n], right, tag=n + step)
        chunks[(r - step) % n][...] = comm.recv(left, tag=n + step)
        request.wait()
    return flat.reshape(_shape(array))


def tree_allreduce(comm, array):
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast back: 2 ceil(log2 N)
    rounds, each carrying the whole array. Few messages (good for small arrays), but
    every message is full size (bad for large ones)."""
    n, r = comm.size, comm.rank
    total = _flat_copy(array)
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    for k in (1 << i for i in range(rounds)):      # reduce: 1, 2, 4, ...
        if r % (2 * k) == k:
            comm.send(total, r - k, tag=k)
        elif r % (2 * k) == 0 and r + k < n:
            total += comm.recv(r + k, tag=k)
    for k in (1 << i for i in reversed(range(rounds))):  # broadcast: ..., 4, 2, 1
        if r % (2 * k) == 0 and r + k < n:
            comm.send(total, r + k, tag=-k)
        elif r % (2 * k) == k:
            total = comm.recv(r - k, tag=-k)
    return total.reshape(_shape(array))
