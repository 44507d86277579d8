"""Exercise checks for chapter 01: message passing (tree all-reduce, deadlock-free exchange)."""

from __future__ import annotations

from ._common import CheckFailed, passed


def _run_simulated(world, fn, inputs, what):
    """world.run(fn) with rank r getting inputs[r]; a blank exercise becomes a CheckFailed."""
    try:
        return world.run(lambda comm: fn(comm, inputs[comm.rank].copy()))
    except NotImplementedError as error:
        raise CheckFailed(f"{what} is not written yet: replace the `raise NotImplementedError` "
                          "line with your code.") from error


def _subset_summed(out, inputs):
    """The ranks whose inputs add up to ``out``, or None (inputs are random integers, so
    a match is no accident)."""
    import itertools

    import numpy as np

    for size in range(1, len(inputs) + 1):
        for ranks in itertools.combinations(range(len(inputs)), size):
            if np.array_equal(out, np.sum([inputs[r] for r in ranks], axis=0)):
                return list(ranks)
    return None


def _tree_values(results, inputs, n):
    """Name the likely mistake when the tree's results are not the sum, else None."""
    import numpy as np

    expected = np.sum(inputs, axis=0)
    wrong = {}
    for rank, out in enumerate(results):
        if out is None:
            return f"rank {rank} returned None: return the summed array."
        out = np.asarray(out, dtype=float)
        if out.shape != expected.shape:
            return f"rank {rank} returned shape {out.shape}, the input has shape {expected.shape}."
        if np.array_equal(out, expected):
            continue
        if np.allclose(out * n, expected):
            return ("the result is the sum divided by the world size: an all-reduce sums. "
                    "(Averaging gradients is a later step, in data parallel training.)")
        wrong[rank] = _subset_summed(out, inputs)
    if not wrong:
        return None
    if len(wrong) == n - 1 and 0 not in wrong:
        return (f"on {n} ranks only rank 0 holds the sum: that is the reduce. The broadcast "
                "back down the tree is missing: rank 0 sends the total to rank k, then both "
                "send it on, until every rank has it.")
    subsets = {tuple(s) if s else None for s in wrong.values()}
    if len(wrong) == n and len(subsets) == 1 and None not in subsets:
        lost = sorted(set(range(n)) - set(next(iter(subsets))))
        return (f"on {n} ranks every rank holds the sum of ranks {list(next(iter(subsets)))} only: "
                f"the contributions of ranks {lost} never reached rank 0. In the reduce a rank "
                "sends its partial sum up only after it has received from all its children: go "
                "through the distances k = 1, 2, 4, ... in that order.")
    rank, ranks = next(iter(wrong.items()))
    if ranks is not None and ranks != [rank]:
        return (f"on {n} ranks rank {rank} ended with the sum of ranks {ranks} only: it got a "
                "partial sum, sent before the sender had the total. Broadcast down the tree in "
                "the reverse order of the reduce (the largest distance first: ..., 4, 2, 1), so "
                "a rank passes the total on only after it has received it.")
    if ranks == [rank]:
        return (f"on {n} ranks rank {rank} returned its own input unchanged: it never received "
                "(or never kept) the total.")
    return (f"on {n} ranks ranks {sorted(wrong)} return wrong values. In round k (k = 1, 2, 4, "
            "... while k < N) of the reduce, rank r with r % (2k) == k sends to r - k, and rank r "
            "with r % (2k) == 0 adds what r + k sends, if r + k < N.")


def check_tree_allreduce(fn) -> None:
    """``fn(comm, array)`` must return the sum over ranks of ``array`` with a binomial tree:
    right values on 1-9 ranks (powers of two and not), and a simulated time of exactly
    2 ceil(log2 N) rounds of one whole array, ``costmodel.allreduce_time``'s tree."""
    import math

    import numpy as np

    from ..costmodel import allreduce_time
    from ..mpi_sim import DeadlockError, World

    alpha, beta = 1e-6, 1e-9
    for n in range(1, 10):
        rng = np.random.default_rng(n)
        inputs = [rng.integers(-999, 1000, size=6).astype(float) for _ in range(n)]
        world = World(n, alpha=alpha, beta=beta)
        try:
            results = _run_simulated(world, fn, inputs, "tree_allreduce")
        except DeadlockError as error:
            raise CheckFailed(f"your tree deadlocked on {n} ranks: in every round each send "
                              "needs the matching recv on its partner (same round, same tag). "
                              f"\n{error}") from error
        except ValueError as error:
            if "this world has ranks" not in str(error):
                raise
            raise CheckFailed(
                f"on {n} ranks your tree talks to a rank that does not exist: it works when N is a "
                f"power of two, and {n} is not.\n{error}") from error
        problem = _tree_values(results, inputs, n)
        if problem:
            raise CheckFailed(problem)
        nbytes = inputs[0].nbytes
        rounds = 2 * math.ceil(math.log2(n)) if n > 1 else 0
        expected = allreduce_time(nbytes, n, "tree", alpha, beta)
        if not math.isclose(world.elapsed, expected, rel_tol=1e-9, abs_tol=1e-15):
            took = world.elapsed / (alpha + nbytes * beta)
            raise CheckFailed(
                f"right sums, but on {n} ranks your all-reduce takes as long as {took:.3g} "
                f"messages in a row, a binomial tree {rounds} (2 ceil(log2 N)): your messages wait "
                "for each other (a chain, or everything through one rank) instead of travelling in "
                "rounds where many pairs talk at once.")
    passed("tree all-reduce: right sums on 1-9 ranks, in 2 ceil(log2 N) rounds of the whole "
           "array, as costmodel.allreduce_time says")


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
