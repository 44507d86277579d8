"""Exercise checks for chapter 01: message passing (ring all-reduce, deadlock-free exchange)."""

from __future__ import annotations

from ._common import CheckFailed, passed


def _run_simulated(world, fn, inputs, what):
    """world.run(fn) with rank r getting inputs[r]; a blank exercise becomes a CheckFailed."""
    try:
        return world.run(lambda comm: fn(comm, inputs[comm.rank].copy()))
    except NotImplementedError as error:
        raise CheckFailed(f"{what} is not written yet: replace the `raise NotImplementedError` "
                          "line with your code.") from error


def _ring_values(results, inputs, n):
    """Name the likely mistake when the ring's results are not the sum, else None."""
    import numpy as np

    expected = np.sum(inputs, axis=0)
    pieces = np.array_split(np.arange(expected.size), n)
    for rank, out in enumerate(results):
        if out is None:
            return f"rank {rank} returned None: return the summed array."
        out = np.asarray(out, dtype=float)
        if out.shape != expected.shape:
            return (f"rank {rank} returned shape {out.shape}, the input has shape {expected.shape}: "
                    "return the whole array (all N chunks), not only the chunk that rank reduced.")
        if np.allclose(out, expected):
            continue
        if np.allclose(out * n, expected):
            return ("the result is the sum divided by the world size: an all-reduce sums. "
                    "(Averaging gradients is a later step, in data parallel training.)")
        if np.allclose(out, inputs[rank]):
            return (f"rank {rank} returned its own input unchanged: the sums never reached the "
                    "array you returned. np.array_split returns views into the array it cuts; "
                    "add into those chunks in place and return that array.")
        right = [i for i, p in enumerate(pieces) if np.allclose(out[p], expected[p])]
        if len(right) == 1:
            return (f"on {n} ranks, rank {rank} has only chunk {right[0]} fully summed: that is "
                    "where the reduce-scatter ends. The all-gather is missing (or does not write "
                    "into the array): N-1 more steps in which each rank passes on a finished "
                    "chunk and overwrites its copy with the one it receives.")
        return (f"on {n} ranks, rank {rank} has wrong values in chunks "
                f"{[i for i in range(n) if i not in right]}. Most likely the chunk indices: in "
                "reduce-scatter step s rank r sends chunk (r - s) % N and adds the chunk it "
                "receives into chunk (r - s - 1) % N; in all-gather step s it sends chunk "
                "(r - s + 1) % N and overwrites chunk (r - s) % N with what it receives.")
    return None


def _ring_traffic(world, n, length, itemsize):
    """Name the likely mistake when the ring's messages are not 2(N-1) chunks to the right."""
    counts, sent = world.messages_per_rank(), world.bytes_per_rank()
    for m in world.trace:
        if m.dest != (m.source + 1) % n:
            return (f"on {n} ranks rank {m.source} sent a message to rank {m.dest}: in a ring each "
                    "rank sends only to its right neighbour (rank + 1) % N and receives only from "
                    "its left one (rank - 1) % N.")
    for rank in range(n):
        if counts[rank] != 2 * (n - 1):
            half = " (only one of the two phases?)" if counts[rank] == n - 1 else ""
            return (f"on {n} ranks rank {rank} sent {counts[rank]} messages{half}; a ring all-reduce "
                    f"sends exactly 2(N-1) = {2 * (n - 1)}: N-1 in the reduce-scatter and N-1 in "
                    "the all-gather, one chunk each.")
        low, high = (2 * (n - 1) * (length // n) * itemsize,
                     2 * (n - 1) * -(-length // n) * itemsize)
        if not low <= sent[rank] <= high:
            whole = " It sends the whole array in some steps instead of one chunk." \
                if sent[rank] >= (n - 1) * length * itemsize else ""
            return (f"on {n} ranks rank {rank} sent {sent[rank]:,} bytes; a ring sends 2(N-1) chunks "
                    f"of about 1/N of the array ({low:,} to {high:,} bytes here).{whole}")
    return None


def check_ring_allreduce(fn) -> None:
    """``fn(comm, array)`` must return the sum over ranks of ``array`` with a ring:
    right values on 2-8 ranks (array lengths that N divides and that it does not),
    exactly 2(N-1) messages of one chunk per rank, all to the right neighbour, and no
    deadlock when no send is buffered (every send waits for its receive)."""
    import numpy as np

    from ..mpi_sim import DeadlockError, World

    for n in range(2, 9):
        for length in (4 * n, 4 * n + 3):
            rng = np.random.default_rng(100 * n + length)
            inputs = [rng.integers(-9, 10, size=length).astype(float) for _ in range(n)]
            world = World(n)
            try:
                results = _run_simulated(world, fn, inputs, "ring_allreduce")
            except DeadlockError as error:
                raise CheckFailed(f"your ring deadlocked on {n} ranks. Check that every rank "
                                  "receives from (rank - 1) % N what that rank sends to it (same "
                                  f"tag too).\n{error}") from error
            problem = _ring_values(results, inputs, n)
            if problem and length % n:  # the length N divides passed just before
                problem = (f"wrong only when N = {n} does not divide the length ({length}): cut "
                           "the chunks with np.array_split, which makes some one element longer; "
                           "length // N drops the remainder.\n(" + problem + ")")
            problem = problem or _ring_traffic(world, n, length, 8)
            if problem:
                raise CheckFailed(problem)
    inputs = [np.full(64, float(r + 1)) for r in range(4)]
    try:
        _run_simulated(World(4, eager_limit=0), fn, inputs, "ring_allreduce")
    except DeadlockError as error:
        if all(w.startswith("send(") for w in error.waiting.values()):
            raise CheckFailed(
                "your ring works only while sends are buffered. With a message too large to "
                "buffer, a blocking send waits until the receiver posts its recv (MPI allows "
                "it, real libraries do it), and in a ring every rank sends first: all wait. "
                "Start the send with req = comm.isend(...), then comm.recv(...), then "
                f"req.wait().\n{error}") from error
        raise CheckFailed(f"your ring deadlocks when sends are not buffered:\n{error}") from error
    passed("ring all-reduce: right sums on 2-8 ranks, 2(N-1) messages of about 1/N of the array "
           "per rank, and no deadlock when sends are not buffered")


def check_exchange(fn) -> None:
    """``fn(comm, data)`` must send ``data`` to rank (rank + 1) % N and return what rank
    (rank - 1) % N sent, on 2-4 ranks, with no send buffered (every send waits for its
    receive), without deadlocking."""
    import numpy as np

    from ..mpi_sim import DeadlockError, World

    for n in (2, 3, 4):
        inputs = [np.full(1000, float(r)) for r in range(n)]
        world = World(n, eager_limit=0)
        try:
            results = _run_simulated(world, fn, inputs, "exchange")
        except DeadlockError as error:
            waits = list(error.waiting.values())
            if waits and all(w.startswith("recv(") for w in waits):
                why = ("every rank blocks in recv before anyone has sent. Post the receive "
                       "without blocking (req = comm.irecv(left)), then send, then req.wait().")
            elif waits and all(w.startswith("send(") for w in waits):
                why = ("every rank blocks in a blocking send: a message too large to buffer waits "
                       "until its receiver posts the recv, and every receiver is itself sending. "
                       "Use comm.isend (or post comm.irecv first) and wait() afterwards.")
            else:
                why = "the ranks wait for each other; the simulator's report follows."
            raise CheckFailed(f"deadlock on {n} ranks: {why}\n{error}") from error
        for rank, got in enumerate(results):
            left, right = (rank - 1) % n, (rank + 1) % n
            if got is None:
                raise CheckFailed(f"rank {rank} returned None: return what it received "
                                  "(req.wait() on an irecv returns the object).")
            got = np.asarray(got, dtype=float)
            if got.shape == inputs[rank].shape and np.array_equal(got, inputs[left]):
                continue
            if got.shape == inputs[rank].shape and np.array_equal(got, inputs[rank]) and n > 1:
                raise CheckFailed(f"rank {rank} returned its own data: return what it received "
                                  "from its left neighbour, not what it sent.")
            if got.shape == inputs[rank].shape and np.array_equal(got, inputs[right]):
                raise CheckFailed(f"on {n} ranks rank {rank} got the data of rank {right}: send "
                                  "to the right neighbour (rank + 1) % N and receive from the left "
                                  "one (rank - 1) % N.")
            raise CheckFailed(f"on {n} ranks rank {rank} returned something else than the data of "
                              f"rank {left}, its left neighbour.")
        counts = world.messages_per_rank()
        if counts != [1] * n:
            raise CheckFailed(f"on {n} ranks the ranks sent {counts} messages: each sends exactly "
                              "one, to its right neighbour.")
    passed("exchange: every rank got its left neighbour's data on 2-4 ranks, one message each, "
           "and no deadlock even when no send is buffered")
