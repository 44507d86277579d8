"""Exercise checks for chapter 02: distributed sampling."""

from __future__ import annotations

from ._common import CheckFailed, passed
from ._guard import borrowing_refused


def _sampler_orders(sampler_cls, size, replicas, shuffle, drop_last, epochs, seed):
    """orders[epoch][rank] from fresh samplers, one per rank, as the ranks of a job would build them."""
    dataset = list(range(size))
    samplers = [sampler_cls(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                            drop_last=drop_last) for rank in range(replicas)]
    orders = []
    for epoch in range(epochs):
        for sampler in samplers:
            if not callable(getattr(sampler, "set_epoch", None)):
                raise CheckFailed(
                    f"{sampler_cls.__name__} has no set_epoch(epoch) method, which DataLoader users call "
                    "every epoch: without it every epoch repeats the same order.")
            sampler.set_epoch(epoch)
        orders.append([[int(i) for i in sampler] for sampler in samplers])
    return samplers, orders


def _check_own_order(sampler_cls, DistributedSampler) -> None:
    """The exercise is to write the order: a sampler that takes it from torch's passes trivially."""
    if not issubclass(sampler_cls, DistributedSampler):
        return
    inherited = [name for name in ("__iter__", "__len__")
                 if getattr(sampler_cls, name) is getattr(DistributedSampler, name)]
    if inherited:
        raise CheckFailed(f"{sampler_cls.__name__} inherits {' and '.join(inherited)} from "
                          "torch's DistributedSampler: the order it gives is torch's, not yours, so "
                          "this check would compare DistributedSampler with itself.")


def _torch_sampler_code(DistributedSampler) -> list:
    """The methods of torch's sampler that compute the answer: its sizes and its order."""
    return [DistributedSampler.__init__, DistributedSampler.__iter__, DistributedSampler.__len__]


def _how_it_differs(ranks: list, expected: list) -> str:
    """Which part of the order differs from DistributedSampler's: within a rank's share, the
    cut between ranks, or the order (shuffle, padding) they are cut from."""
    if all(sorted(a) == sorted(b) for a, b in zip(ranks, expected)):
        return "every rank has the right samples, in another order within its share."
    if sorted(i for r in ranks for i in r) == sorted(i for r in expected for i in r):
        return "the same samples in all, but cut between the ranks another way."
    return "the order the shares are cut from (its shuffle, or its padding) is another one."


def check_sampler(sampler_cls, sizes=(8, 10, 11, 13), replicas=(1, 2, 3, 4), epochs: int = 3,
                  seed: int = 0, exact: bool = True) -> None:
    """Check a sampler class with DistributedSampler's contract against the real one.

    ``sampler_cls(dataset, num_replicas=, rank=, shuffle=, seed=, drop_last=)`` must give every
    rank the same number of indices, disjoint slices that together cover the data set (padding
    with repeats, or dropping the tail with ``drop_last``), a new shuffle each ``set_epoch``,
    and (``exact=True``) the very order of ``torch.utils.data.distributed.DistributedSampler``.
    """
    from collections import Counter
    from itertools import product

    from torch.utils.data.distributed import DistributedSampler

    _check_own_order(sampler_cls, DistributedSampler)
    runs = []
    for size, n, shuffle, drop_last in product(sizes, replicas, (True, False), (False, True)):
        where = f"(data set of {size}, num_replicas={n}, shuffle={shuffle}, drop_last={drop_last})"
        options = (size, n, shuffle, drop_last, epochs, seed)
        # A sampler that hands the work to torch's (wrapping it, or by super()) is torch's.
        with borrowing_refused(sampler_cls.__name__, _torch_sampler_code(DistributedSampler),
                               "The exercise asks for the sizes and the order worked out by your own code."):
            samplers, orders = _sampler_orders(sampler_cls, *options)
        _, expected = _sampler_orders(DistributedSampler, *options)
        runs.append((where, orders, expected))
        for epoch, order in enumerate(orders):
            _check_partition(order, len(expected[0][0]), size, drop_last, epoch, where, samplers, Counter)
        if shuffle and size > 4 and all(o == orders[0] for o in orders[1:]):
            raise CheckFailed(
                f"every epoch gives the same order {where}: set_epoch has no effect on the shuffle, as "
                "if it were never called.")
    # The partitions are valid everywhere; now are they DistributedSampler's very own?
    for where, orders, expected in runs if exact else ():
        if orders != expected:
            epoch, rank = next((e, r) for e in range(len(orders)) for r in range(len(orders[e]))
                               if orders[e][r] != expected[e][r])
            raise CheckFailed(
                f"a valid partition, but not DistributedSampler's {where}: in epoch {epoch} rank "
                f"{rank} reads {orders[epoch][rank]}, DistributedSampler gives {expected[epoch][rank]}: "
                + _how_it_differs(orders[epoch], expected[epoch]))
    passed(f"{sampler_cls.__name__} partitions like DistributedSampler (sizes {list(sizes)}, "
           f"{list(replicas)} replicas, shuffle and drop_last on and off, {epochs} epochs)")


def _check_partition(order, per_rank, size, drop_last, epoch, where, samplers, Counter):
    for rank, (indices, sampler) in enumerate(zip(order, samplers)):
        if len(indices) != per_rank or len(sampler) != len(indices):
            raise CheckFailed(
                f"rank {rank} reads {len(indices)} indices and says len() == {len(sampler)} in epoch {epoch} "
                f"{where}; every rank must read exactly {per_rank}. Ranks with fewer batches leave the "
                "loop early and the others hang in their next all-reduce: pad by repeating indices "
                "(drop_last=False) or drop the tail (drop_last=True) so the total divides by num_replicas.")
        outside = [i for i in indices if not 0 <= i < size]
        if outside:
            raise CheckFailed(f"rank {rank} reads indices {outside} outside the data set {where}")
    counts = Counter(i for indices in order for i in indices)
    padding = 0 if drop_last else per_rank * len(order) - size
    owners = {}
    for rank, indices in enumerate(order):
        for index in indices:
            owners.setdefault(index, set()).add(rank)
    shared = sorted(i for i, who in owners.items() if len(who) > 1)
    repeats = sum(c - 1 for c in counts.values())
    if repeats > padding or (padding == 0 and shared):
        index = shared[0] if shared else next(i for i, c in counts.items() if c > 1)
        who = sorted(owners[index])
        raise CheckFailed(
            f"the ranks overlap in epoch {epoch} {where}: index {index} is read by ranks {who}, "
            f"{repeats} repeats where at most {padding} (padding) are allowed: the ranks did not cut "
            "their shares from one common order (a rank that ignores its rank, or shuffles with a seed "
            "of its own, reads its neighbours' samples).")
    missing = sorted(set(range(size)) - set(counts))
    allowed_missing = size - per_rank * len(order) if drop_last else 0
    if len(missing) > allowed_missing:
        raise CheckFailed(
            f"the ranks together skip indices {missing[:10]} in epoch {epoch} {where}: the partition is "
            "not complete. Every index must go to some rank (only drop_last may drop the few that do "
            "not divide by num_replicas).")
