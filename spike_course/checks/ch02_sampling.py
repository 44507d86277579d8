"""Exercise checks for chapter 02: distributed sampling."""

from __future__ import annotations

import functools
from collections import Counter

from ._common import CheckFailed, Mistake, name_the_first, passed
from ._guard import borrowing_refused

# The class itself, before any order is read (readings: the class, and torch's sampler).
NO_SET_EPOCH = Mistake(
    "no set_epoch", lambda cls, sampler: not callable(getattr(sampler, "set_epoch", None)),
    lambda cls, sampler: f"{cls.__name__} has no set_epoch(epoch) method, which DataLoader users call every "
                         "epoch: without it every epoch repeats the same order.")


def _inherited(cls, DistributedSampler) -> list[str]:
    """The methods that give the order which ``cls`` takes unchanged from torch's sampler."""
    if not issubclass(cls, DistributedSampler):
        return []
    return [name for name in ("__iter__", "__len__") if getattr(cls, name) is getattr(DistributedSampler, name)]


# The exercise is to write the order: a sampler that takes it from torch's passes trivially.
TORCHS_ORDER_INHERITED = Mistake(
    "torch's order inherited", lambda cls, DistributedSampler: bool(_inherited(cls, DistributedSampler)),
    lambda cls, DistributedSampler: f"{cls.__name__} inherits {' and '.join(_inherited(cls, DistributedSampler))} "
                                    "from torch's DistributedSampler: the order it gives is torch's, not yours, so "
                                    "this check would compare DistributedSampler with itself.")


def _sampler_orders(sampler_cls, size, replicas, shuffle, drop_last, epochs, seed):
    """orders[epoch][rank] from fresh samplers, one per rank, as the ranks of a job would build them."""
    dataset = list(range(size))
    samplers = [sampler_cls(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                            drop_last=drop_last) for rank in range(replicas)]
    orders = []
    for epoch in range(epochs):
        for sampler in samplers:
            name_the_first((NO_SET_EPOCH,), sampler_cls, sampler)
            sampler.set_epoch(epoch)
        orders.append([[int(i) for i in sampler] for sampler in samplers])
    return samplers, orders


def _torch_sampler_code(DistributedSampler) -> list:
    """The methods of torch's sampler that compute the answer: its sizes and its order."""
    return [DistributedSampler.__init__, DistributedSampler.__iter__, DistributedSampler.__len__]


class _Epoch:
    """One epoch's order of every rank (``order[rank]``), for a data set of ``size`` that each
    rank should read ``per_rank`` of, and what the check reads in it."""

    def __init__(self, order, samplers, per_rank, size, drop_last, epoch, where):
        self.order, self.samplers, self.per_rank, self.size = order, samplers, per_rank, size
        self.epoch, self.where = epoch, where
        self.padding = 0 if drop_last else per_rank * len(order) - size

    @property
    def uneven(self):
        """The first (rank, its indices, its sampler) that reads another number than per_rank, or None."""
        return next(((rank, indices, sampler) for rank, (indices, sampler) in enumerate(zip(self.order, self.samplers))
                     if len(indices) != self.per_rank or len(sampler) != len(indices)), None)

    @property
    def outside(self):
        """The first (rank, its indices outside the data set), or None."""
        return next(((rank, bad) for rank, indices in enumerate(self.order)
                     if (bad := [i for i in indices if not 0 <= i < self.size])), None)

    @functools.cached_property
    def owners(self) -> dict:
        owners = {}
        for rank, indices in enumerate(self.order):
            for index in indices:
                owners.setdefault(index, set()).add(rank)
        return owners

    @functools.cached_property
    def counts(self) -> Counter:
        return Counter(i for indices in self.order for i in indices)

    @property
    def repeats(self) -> int:
        return sum(c - 1 for c in self.counts.values())

    @property
    def overlapping(self) -> int | None:
        """An index read by more than one rank beyond the padding's repeats, or None."""
        shared = sorted(i for i, who in self.owners.items() if len(who) > 1)
        if self.repeats > self.padding or (self.padding == 0 and shared):
            return shared[0] if shared else next(i for i, c in self.counts.items() if c > 1)
        return None


# What one epoch's partition shows, in this order (readings: the epoch).
PARTITION_MISTAKES = (
    Mistake("uneven shares", lambda e: e.uneven is not None,
            lambda e: f"rank {e.uneven[0]} reads {len(e.uneven[1])} indices and says len() == {len(e.uneven[2])} in "
                      f"epoch {e.epoch} {e.where}; every rank must read exactly {e.per_rank}. Ranks with fewer batches "
                      "leave the loop early and the others hang in their next all-reduce: pad by repeating indices "
                      "(drop_last=False) or drop the tail (drop_last=True) so the total divides by num_replicas."),
    Mistake("indices outside the data set", lambda e: e.outside is not None,
            lambda e: f"rank {e.outside[0]} reads indices {e.outside[1]} outside the data set {e.where}"),
    Mistake("ranks overlap", lambda e: e.overlapping is not None,
            lambda e: f"the ranks overlap in epoch {e.epoch} {e.where}: index {e.overlapping} is read by ranks "
                      f"{sorted(e.owners[e.overlapping])}, {e.repeats} repeats where at most {e.padding} (padding) "
                      "are allowed: the ranks did not cut their shares from one common order (a rank that ignores "
                      "its rank, or shuffles with a seed of its own, reads its neighbours' samples)."),
)

# Every epoch the same shuffle (readings: the orders of every epoch, shuffle, the data set's size).
SAME_ORDER_EVERY_EPOCH = Mistake(
    "same order every epoch",
    lambda orders, shuffle, size, where: shuffle and size > 4 and all(o == orders[0] for o in orders[1:]),
    lambda orders, shuffle, size, where: f"every epoch gives the same order {where}: set_epoch has no effect on "
                                         "the shuffle, as if it were never called.")

# A valid partition that is not DistributedSampler's: which part of the order differs (readings:
# the ranks' orders of one epoch, and torch's).
NOT_TORCHS_ORDER = (
    Mistake("another order within a share", lambda ranks, expected: all(sorted(a) == sorted(b)
                                                                         for a, b in zip(ranks, expected)),
            "every rank has the right samples, in another order within its share."),
    Mistake("cut between the ranks another way",
            lambda ranks, expected: sorted(i for r in ranks for i in r) == sorted(i for r in expected for i in r),
            "the same samples in all, but cut between the ranks another way."),
    Mistake("another shuffle or padding", lambda ranks, expected: True,
            "the order the shares are cut from (its shuffle, or its padding) is another one."),
)


def check_sampler(sampler_cls, sizes=(8, 10, 11, 13), replicas=(1, 2, 3, 4), epochs: int = 3,
                  seed: int = 0, exact: bool = True) -> None:
    """Check a sampler class with DistributedSampler's contract against the real one.

    ``sampler_cls(dataset, num_replicas=, rank=, shuffle=, seed=, drop_last=)`` must give every
    rank the same number of indices, disjoint slices that together cover the data set (padding
    with repeats, or dropping the tail with ``drop_last``), a new shuffle each ``set_epoch``,
    and (``exact=True``) the very order of ``torch.utils.data.distributed.DistributedSampler``.
    """
    from itertools import product

    from torch.utils.data.distributed import DistributedSampler

    name_the_first((TORCHS_ORDER_INHERITED,), sampler_cls, DistributedSampler)
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
            _check_partition(_Epoch(order, samplers, len(expected[0][0]), size, drop_last, epoch, where))
        name_the_first((SAME_ORDER_EVERY_EPOCH,), orders, shuffle, size, where)
    # The partitions are valid everywhere; now are they DistributedSampler's very own?
    for where, orders, expected in runs if exact else ():
        if orders != expected:
            epoch, rank = next((e, r) for e in range(len(orders)) for r in range(len(orders[e]))
                               if orders[e][r] != expected[e][r])
            name_the_first(NOT_TORCHS_ORDER, orders[epoch], expected[epoch], before=(
                f"a valid partition, but not DistributedSampler's {where}: in epoch {epoch} rank {rank} reads "
                f"{orders[epoch][rank]}, DistributedSampler gives {expected[epoch][rank]}: "))
    passed(f"{sampler_cls.__name__} partitions like DistributedSampler (sizes {list(sizes)}, "
           f"{list(replicas)} replicas, shuffle and drop_last on and off, {epochs} epochs)")


def _check_partition(e: _Epoch) -> None:
    """Every rank reads per_rank indices of the data set, the ranks' shares are disjoint beyond the
    padding, and together they cover the data set (but for what drop_last drops)."""
    name_the_first(PARTITION_MISTAKES, e)
    missing = sorted(set(range(e.size)) - set(e.counts))
    allowed_missing = e.size - e.per_rank * len(e.order) if e.padding == 0 else 0
    if len(missing) > allowed_missing:  # a guard: equal shares without overlap leave none missing
        raise CheckFailed(
            f"the ranks together skip indices {missing[:10]} in epoch {e.epoch} {e.where}: the partition is "
            "not complete. Every index must go to some rank (only drop_last may drop the few that do "
            "not divide by num_replicas).")
