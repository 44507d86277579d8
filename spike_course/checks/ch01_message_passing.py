"""Exercise checks for chapter 01: message passing (tree all-reduce, an all-to-all that cannot deadlock)."""

from __future__ import annotations

from ._common import CheckFailed, Mistake, name_the_first, passed


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

    try:
        out = np.asarray(out, dtype=float)
    except (TypeError, ValueError):  # not numbers at all
        return None
    for size in range(1, len(inputs) + 1):
        for ranks in itertools.combinations(range(len(inputs)), size):
            if out.shape == inputs[0].shape and np.array_equal(out, np.sum([inputs[r] for r in ranks], axis=0)):
                return list(ranks)
    return None


class _TreeRun:
    """What one run of a tree all-reduce on ``n`` ranks shows: what each rank returned (as the
    ranks whose inputs it sums), and each message with the ranks whose inputs it carried, read
    from the simulator's record (the answer cannot write it)."""

    def __init__(self, n, inputs, results, world):
        import numpy as np

        self.n, self.inputs, self.results = n, inputs, results
        self.expected = np.sum(inputs, axis=0)
        self.sums = [None if out is None else _subset_summed(out, inputs) for out in results]
        self.messages = [(m, _subset_summed(obj, inputs)) for m, obj in world.delivered()]

    def right(self, rank) -> bool:
        return self.sums[rank] == list(range(self.n))

    def wrong(self) -> list[int]:
        return [r for r in range(self.n) if not self.right(r)]

    def silent(self) -> list[int]:
        """The ranks that neither sent nor received a message."""
        talked = {m.source for m, _ in self.messages} | {m.dest for m, _ in self.messages}
        return [r for r in range(self.n) if r not in talked] if self.n > 1 else []

    def received(self, rank) -> list:
        return [(m, carried) for m, carried in self.messages if m.dest == rank]

    def ended(self, rank) -> str:
        """What rank ``rank`` returned, in words."""
        import numpy as np

        out, ranks = self.results[rank], self.sums[rank]
        if out is None:
            return "None"
        if np.shape(out) != self.expected.shape:
            return f"an array of shape {np.shape(out)}"
        if ranks == [rank]:
            return "its own input"
        return f"the sum of ranks {ranks}" if ranks else "values that are no sum of inputs"

    def returned_none(self) -> list[int]:
        return [r for r, out in enumerate(self.results) if out is None]

    def misshaped(self) -> list[int]:
        import numpy as np

        return [r for r, out in enumerate(self.results) if out is not None and np.shape(out) != self.expected.shape]

    def averaged(self) -> list[int]:
        import numpy as np

        return [r for r, out in enumerate(self.results) if r not in self.misshaped() + self.returned_none()
                and not self.right(r) and np.allclose(np.asarray(out, dtype=float) * self.n, self.expected)]

    def kept_nothing(self) -> list[int]:
        """Ranks that received something and returned their own input all the same."""
        return [r for r in range(self.n) if self.sums[r] == [r] and self.n > 1 and self.received(r)]

    def one_partial_everywhere(self) -> list[int] | None:
        """The ranks of the one partial sum that every rank ended with, if they all did."""
        first = self.sums[0]
        return first if first and not self.right(0) and all(s == first for s in self.sums) else None

    def passed_on_early(self, missing):
        """(x, y, z): rank x sent rank y a partial sum before rank z's message, which carried
        one of ``missing``, reached it."""
        for m, carried in self.messages:
            for later, holds in self.received(m.source):
                if holds and set(holds) & set(missing) and later.arrival_time > m.send_time:
                    return m.source, m.dest, later.source
        return None

    def got_a_partial(self):
        """(x, y, ranks): rank x ended with exactly the partial sum (of ``ranks``) that rank y sent it."""
        for rank in self.wrong():
            for m, carried in reversed(self.received(rank)):
                if carried == self.sums[rank] and carried:
                    return rank, m.source, carried
        return None


def _on(n) -> str:
    return "on 1 rank" if n == 1 else f"on {n} ranks"


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _left_out(run) -> str:
    left = run.silent()
    ended = "; ".join(f"rank {r} returned {run.ended(r)}" for r in left)
    return (f"{_on(run.n)} {_ranks(left)} never sent or received a message: no other rank "
            f"got {'its' if len(left) == 1 else 'their'} input, and {ended}. Do your rounds reach "
            f"{'it' if len(left) == 1 else 'them'}? How many rounds does a tree of {run.n} ranks need, "
            f"when log2({run.n}) is no whole number? (Hint 1)")


def _missing_everywhere(run) -> str:
    ranks = run.one_partial_everywhere()
    missing = sorted(set(range(run.n)) - set(ranks))
    text = (f"{_on(run.n)} every rank ended with the sum of ranks {ranks} only: the inputs of "
            f"{_ranks(missing)} are missing from every result, so the sum that reached them all "
            "was not complete.")
    early = run.passed_on_early(missing)
    if early:
        x, y, z = early
        text += (f" Rank {x} sent its partial sum on to rank {y} before rank {z}'s message reached it: "
                 "a rank may pass its sum up only once all of its partners' have arrived (Hint 1).")
    return text


def _partial_passed_down(run) -> str:
    x, y, ranks = run.got_a_partial()
    return (f"{_on(run.n)} rank {x} ended with the sum of ranks {ranks}, which is what rank {y} "
            f"sent it, a partial sum: rank {y} passed it on before it held the total. In the "
            "broadcast a rank passes on only what it has received from the rank above it (Hint 1: "
            "in which order does the broadcast meet the distances?).")


TREE_MISTAKES = (
    Mistake("returned None", lambda run: bool(run.returned_none()),
            lambda run: f"{_on(run.n)} {_ranks(run.returned_none())} returned None: return the summed array."),
    Mistake("another shape", lambda run: bool(run.misshaped()),
            lambda run: f"{_on(run.n)} rank {run.misshaped()[0]} returned {run.ended(run.misshaped()[0])}; "
                        f"its input has shape {run.expected.shape}."),
    Mistake("averaged", lambda run: bool(run.averaged()),
            lambda run: f"{_on(run.n)} {_ranks(run.averaged())} returned the sum divided by the world "
                        "size: an all-reduce sums. (Averaging gradients is a later step, in data "
                        "parallel training.)"),
    Mistake("a rank left out", lambda run: bool(run.silent()), _left_out),
    Mistake("received, not kept", lambda run: bool(run.kept_nothing()),
            lambda run: f"{_on(run.n)} rank {run.kept_nothing()[0]} received "
                        f"{len(run.received(run.kept_nothing()[0]))} message(s) and returned its own input "
                        "unchanged: what it received was not kept (what becomes of the value recv returns?)."),
    Mistake("no broadcast",
            lambda run: run.right(0) and run.wrong() == list(range(1, run.n))
            and not any(m.source == 0 for m, _ in run.messages),
            lambda run: f"{_on(run.n)} only rank 0 ended with the sum, and rank 0 sent no message: "
                        "the total never went back to the others (the broadcast, Hint 1). "
                        + "; ".join(f"rank {r} returned {run.ended(r)}" for r in run.wrong()) + "."),
    Mistake("reduce out of order", lambda run: run.one_partial_everywhere() is not None, _missing_everywhere),
    Mistake("partial sum passed down", lambda run: run.got_a_partial() is not None, _partial_passed_down),
)


def _whatever_it_was(run) -> str:
    """No mistake of the table fits: say what was seen, and name nothing that was not."""
    return (f"{_on(run.n)} the result is wrong, and not in a way this check knows. What each rank "
            "ended with: " + "; ".join(f"rank {r}: {run.ended(r)}" for r in range(run.n))
            + ". Draw who sends to whom in each round for this N (Hint 1).")


def _run_tree(fn, n, alpha, beta, passed_on):
    """One simulated run of ``fn`` on ``n`` ranks: (inputs, results, world), or a CheckFailed
    for a run that cannot be read (blank, deadlock, a rank that does not exist)."""
    import numpy as np

    from ..mpi_sim import DeadlockError, World

    rng = np.random.default_rng(n)
    inputs = [rng.integers(-999, 1000, size=6).astype(float) for _ in range(n)]
    world = World(n, alpha=alpha, beta=beta)
    try:
        return inputs, _run_simulated(world, fn, inputs, "tree_allreduce"), world
    except DeadlockError as error:
        raise CheckFailed(f"your tree deadlocked {_on(n)}: in every round each send "
                          "needs the matching recv on its partner (same round, same tag). "
                          f"\n{error}") from error
    except ValueError as error:
        if "this world has ranks" not in str(error):
            raise
        worked = f" (it ran on {passed_on[0]}-{passed_on[-1]} ranks)" if passed_on else ""
        raise CheckFailed(f"{_on(n)} your tree talks to a rank that does not exist{worked}: "
                          f"which partners are there when {n} ranks do not pair up evenly? (Hint 1)"
                          f"\n{error}") from error


def check_tree_allreduce(fn) -> None:
    """``fn(comm, array)`` must return the sum over ranks of ``array``: right values on 1-9 ranks
    (powers of two and not), in a simulated time no longer than a binomial tree's 2 ceil(log2 N)
    rounds of one whole array (``costmodel.allreduce_time``'s tree). Any algorithm that is as
    fast passes."""
    import math

    from ..costmodel import allreduce_time

    alpha, beta = 1e-6, 1e-9
    passed_on = []
    for n in range(1, 10):
        inputs, results, world = _run_tree(fn, n, alpha, beta, passed_on)
        run = _TreeRun(n, inputs, results, world)
        if run.wrong():
            name_the_first(TREE_MISTAKES, run)
            raise CheckFailed(_whatever_it_was(run))
        nbytes = inputs[0].nbytes
        rounds = 2 * math.ceil(math.log2(n)) if n > 1 else 0
        expected = allreduce_time(nbytes, n, "tree", alpha, beta)
        if world.elapsed > expected * (1 + 1e-9) + 1e-15:
            took = world.elapsed / (alpha + nbytes * beta)
            raise CheckFailed(
                f"right sums, but {_on(n)} your all-reduce takes as long as {took:.3g} "
                f"messages in a row, where a binomial tree needs {rounds} (2 ceil(log2 N)): your "
                "messages wait for each other (a chain, or everything through one rank) instead of "
                "travelling in rounds where many pairs talk at once.")
        passed_on.append(n)
    passed("tree all-reduce: right sums on 1-9 ranks, within the time of 2 ceil(log2 N) rounds of "
           "the whole array, as costmodel.allreduce_time says")


# Exercise 2. Why the ranks deadlocked, told by what each one was waiting in (the simulator's
# report follows each message).
DEADLOCK_MISTAKES = (
    Mistake("receive first", lambda n, waits, error: bool(waits) and all(w.startswith("recv(") for w in waits),
            lambda n, waits, error: f"deadlock on {n} ranks: every rank blocks in a receive before anyone has sent, "
                                    "so no rank reaches a send: the first calls must not wait (Hint 1; the calls "
                                    f"that return at once are in Hint 2).\n{error}"),
    Mistake("blocking send first", lambda n, waits, error: bool(waits) and all(w.startswith("send(") for w in waits),
            lambda n, waits, error: f"deadlock on {n} ranks: every rank blocks in a send: a message too large to "
                                    "buffer waits until its receiver has posted the receive, and every receiver is "
                                    f"itself sending (Hint 1).\n{error}"),
)


class _Received:
    """What rank ``rank`` of ``n`` returned (``got``), against what each rank had for it: on
    rank s, ``items[j]`` is filled with 100 s + j, so a value says who sent it and for whom."""

    def __init__(self, n, rank, got):
        import numpy as np

        self.n, self.rank, self.got = n, rank, got
        self.values = None
        if isinstance(got, (list, tuple)) and len(got) == n:
            try:
                self.values = [float(np.asarray(item, dtype=float).flat[0]) if np.ndim(item) == 1 else None
                               for item in got]
            except (TypeError, ValueError):  # not numbers
                self.values = None
        self.expected = [100.0 * sender + rank for sender in range(n)]

    @property
    def whole_lists(self) -> bool:
        import numpy as np

        return isinstance(self.got, (list, tuple)) and any(np.ndim(item) == 2 for item in self.got
                                                           if not isinstance(item, str))


ALL_TO_ALL_MISTAKES = (
    Mistake("nothing returned", lambda x: not isinstance(x.got, (list, tuple)) or len(x.got) != x.n,
            lambda x: f"on {x.n} ranks rank {x.rank} returned {type(x.got).__name__}"
                      + (f" of {len(x.got)}" if isinstance(x.got, (list, tuple)) else "")
                      + f": it must return a list of {x.n} arrays, one from each rank, its own among them."),
    Mistake("own items returned", lambda x: x.values == [100.0 * x.rank + j for j in range(x.n)] != x.expected,
            lambda x: f"on {x.n} ranks rank {x.rank} returned the items it had for the others: what it was owed "
                      "is what the others had for it, which only messages bring."),
    Mistake("whole list sent", lambda x: x.whole_lists,
            lambda x: f"on {x.n} ranks rank {x.rank} received whole lists: each rank sent all its items to every "
                      "rank, where each peer is owed only the one item meant for it."),
    Mistake("own slot sent to all", lambda x: x.values is not None and all(
                x.values[j] == 101.0 * j for j in range(x.n) if j != x.rank),
            lambda x: f"on {x.n} ranks every rank sent rank {x.rank} the item at its own place in the list "
                      "(rank j sent items[j]): a rank owes each peer the item at the peer's place."),
    Mistake("out of order", lambda x: x.values is not None and x.values != x.expected
            and sorted(v for v in x.values if v is not None) == sorted(x.expected),
            lambda x: f"on {x.n} ranks rank {x.rank} holds every item it is owed, but in another order "
                      f"(from ranks {[_sender(v) for v in x.values]} at places 0-{x.n - 1}): the item from "
                      "rank j belongs at place j."),
    Mistake("own item misplaced", lambda x: x.values is not None and x.values[x.rank] != x.expected[x.rank],
            lambda x: f"on {x.n} ranks rank {x.rank}'s own place holds {_value(x.values[x.rank])}: a rank keeps "
                      "its own item, at its own place in the list, without a message."),
)

SENT_OTHER_THAN_ONE_EACH = Mistake(
    "not one message per peer", lambda n, counts: counts != [n - 1] * n,
    lambda n, counts: f"on {n} ranks the ranks sent {counts} messages: one to every other rank, {n - 1} each "
                      "(a rank's own item needs no message).")


def _sender(value) -> int | None:
    return None if value is None else int(value // 100)


def _value(value) -> str:
    return "nothing" if value is None else f"the item rank {_sender(value)} had for rank {int(value % 100)}"


def check_all_to_all(fn) -> None:
    """``fn(comm, items)`` must return, on rank r, the list of what each rank had for r (its
    ``items[r]``), on 2-5 ranks with no send buffered, without deadlocking, sending one message
    to every other rank."""
    import numpy as np

    from ..mpi_sim import DeadlockError, World

    for n in (2, 3, 4, 5):
        inputs = [[np.full(1000, 100.0 * sender + j) for j in range(n)] for sender in range(n)]
        world = World(n, eager_limit=0)
        try:  # what a rank returns is compared with 100 * sender + place, whatever it did to its items
            results = _run_simulated(world, fn, inputs, "all_to_all")
        except DeadlockError as error:
            name_the_first(DEADLOCK_MISTAKES, n, list(error.waiting.values()), error)
            raise CheckFailed(f"deadlock on {n} ranks: the ranks wait for each other; the simulator's report "
                              f"follows.\n{error}") from error
        for rank, got in enumerate(results):
            received = _Received(n, rank, got)
            if received.values == received.expected:
                continue
            name_the_first(ALL_TO_ALL_MISTAKES, received)
            raise CheckFailed(f"on {n} ranks rank {rank} returned {received.values or got!r:.300}, where place j "
                              f"holds the item rank j had for it ({received.expected}, as 100 * sender + place).")
        name_the_first((SENT_OTHER_THAN_ONE_EACH,), n, world.messages_per_rank())
    passed("all-to-all: every rank got the item each rank had for it, on 2-5 ranks, one message per peer, "
           "and no deadlock even when no send is buffered")
