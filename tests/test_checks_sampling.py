"""Chapter 02's check: a sampler with DistributedSampler's contract passes, and each mistake
of the check's tables, planted in a sampler class of its own, is named."""

import math

import pytest
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from spike_course import checks
from spike_course.checks import CheckFailed, ch02_sampling as sampling
from named import mistake_of, names


class GoodSampler(Sampler):
    """DistributedSampler's contract, written out (what the chapter 02 exercise asks for)."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        per_rank = self.n // num_replicas if drop_last else math.ceil(self.n / num_replicas)
        self.total = per_rank * num_replicas

    def order(self):
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self):
        order = self.order()
        order = (order * math.ceil(self.total / self.n))[:self.total]  # pad, or cut with drop_last
        return iter(order[self.rank:self.total:self.replicas])

    def __len__(self):
        return self.total // self.replicas

    def set_epoch(self, epoch):
        self.epoch = epoch


class IgnoresRank(GoodSampler):
    def __iter__(self):
        return iter((self.order() * 2)[:len(self)])  # every rank reads the same first indices


class OwnSeedPerRank(GoodSampler):
    def order(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch + 100 * self.rank)  # each rank its own shuffle
        return torch.randperm(self.n, generator=g).tolist()


class NoSetEpoch(GoodSampler):
    set_epoch = None


class IgnoresEpoch(GoodSampler):
    def set_epoch(self, epoch):
        pass  # forgets the epoch: the same shuffle forever


class UnevenShards(GoodSampler):
    def __iter__(self):
        return iter(self.order()[self.rank::self.replicas])  # no padding: ranks differ in length


class OffByOne(GoodSampler):
    def __iter__(self):
        return iter(i + 1 for i in super().__iter__())  # indices 1..n, one past the data set


class Inherits(DistributedSampler):
    pass


class CallsSuper(DistributedSampler):
    """Its own methods, each handing the work to torch's by super() (issue 40's audit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def __iter__(self):
        return super().__iter__()

    def __len__(self):
        return super().__len__()


class Wraps:
    """A class of its own that keeps a DistributedSampler inside and passes its order on."""

    def __init__(self, *args, **kwargs):
        self.inner = DistributedSampler(*args, **kwargs)

    def __iter__(self):
        return iter(list(self.inner))

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)


class Blocks(Sampler):
    """A valid partition, but contiguous blocks of the shuffled order instead of a stride."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.size, self.rank, self.replicas = len(dataset), rank, num_replicas
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.per_rank = self.size // num_replicas if drop_last else math.ceil(self.size / num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.per_rank

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=g).tolist() if self.shuffle else list(range(self.size))
        total = self.per_rank * self.replicas
        order = (order + order[:max(0, total - len(order))])[:total]
        return iter(order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank])


class WithinShare(GoodSampler):
    def __iter__(self):
        return reversed(list(super().__iter__()))  # the right share, backwards


class OwnPadding(GoodSampler):
    def __iter__(self):
        order = self.order()
        order = (order + order[-1:] * self.total)[:self.total]  # pads with the last index, torch with the first
        return iter(order[self.rank:self.total:self.replicas])


# A mistake of the check's tables -> a sampler with it, and what its message says.
PLANTS = {
    "torch's order inherited (DistributedSampler itself)": (DistributedSampler, "inherits __iter__ and __len__ from "
                                                             "torch's DistributedSampler"),
    "torch's order inherited (an empty subclass)": (Inherits, "inherits __iter__ and __len__"),
    "no set_epoch": (NoSetEpoch, "has no set_epoch"),
    "same order every epoch": (IgnoresEpoch, "set_epoch has no effect"),
    "uneven shares": (UnevenShards, "every rank must read exactly"),
    "indices outside the data set": (OffByOne, r"reads indices \[\d+\] outside the data set"),
    "ranks overlap (every rank reads the same)": (IgnoresRank, "ranks overlap"),
    "ranks overlap (a seed per rank)": (OwnSeedPerRank, "ranks overlap"),
    "another order within a share": (WithinShare, "in another order within its share"),
    "cut between the ranks another way": (Blocks, "cut between the ranks another way"),
    "another shuffle or padding": (OwnPadding, "its shuffle, or its padding"),
}
CHECK_MODULE = sampling  # tests/named.py


def test_a_faithful_copy_passes(capsys):
    checks.check_sampler(GoodSampler)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", PLANTS)
def test_each_mistake_is_named(name):
    sampler, says = PLANTS[name]
    with names(mistake_of(name), says=says) as failure:
        checks.check_sampler(sampler)
    assert "rank:total_size" not in str(failure.value) and "randperm" not in str(failure.value)  # not the recipe


@pytest.mark.parametrize("sampler", [CallsSuper, Wraps])
def test_handing_the_work_to_torchs_sampler_is_not_an_answer(sampler):
    with pytest.raises(CheckFailed) as failure:
        checks.check_sampler(sampler)
    assert str(failure.value).startswith(f"BorrowedAnswer: {sampler.__name__} calls DistributedSampler.__"), failure
