"""The checks of chapters 02 and 03 pass right answers and name the mistake in wrong ones."""

import math

import pytest
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from spike_course import checks


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


def message(call) -> str:
    with pytest.raises(checks.CheckFailed) as info:
        call()
    return str(info.value)


def test_the_real_sampler_and_a_faithful_copy_pass():
    checks.check_sampler(DistributedSampler)
    checks.check_sampler(GoodSampler)


@pytest.mark.parametrize("sampler", [IgnoresRank, OwnSeedPerRank])
def test_overlapping_ranks_are_named(sampler):
    assert "ranks overlap" in message(lambda: checks.check_sampler(sampler))


@pytest.mark.parametrize("sampler", [NoSetEpoch, IgnoresEpoch])
def test_a_missing_set_epoch_is_named(sampler):
    assert "set_epoch" in message(lambda: checks.check_sampler(sampler))


def test_uneven_shards_are_named():
    assert "every rank must read exactly" in message(lambda: checks.check_sampler(UnevenShards))


def _training_results(world_size=2, sum_only=False, broadcast=True, all_reduce=True):
    """A fake launch: ranks' initial weights, first-step gradients and final weights."""
    torch.manual_seed(0)
    initial = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    final = {k: initial[k] - 0.1 * grads[k] for k in initial}
    reference = {"initial": initial, "grads": grads, "final": final}
    ranks = {}
    for rank in range(world_size):
        start = initial if broadcast or rank == 0 else {k: v + 0.5 for k, v in initial.items()}
        g = {k: v * (world_size if sum_only else 1) for k, v in grads.items()}
        if not all_reduce:
            g = {k: v + rank for k, v in g.items()}
        ranks[rank] = {"initial": start, "grads": g, "final": {k: start[k] - 0.1 * g[k] for k in start}}
    return ranks, reference


def test_right_data_parallel_passes():
    checks.check_data_parallel(*_training_results())


def test_summed_not_averaged_is_named():
    text = message(lambda: checks.check_data_parallel(*_training_results(sum_only=True)))
    assert "summed but not averaged" in text and "world size" in text


def test_missing_broadcast_is_named():
    text = message(lambda: checks.check_data_parallel(*_training_results(broadcast=False)))
    assert "not broadcast" in text


def test_missing_all_reduce_is_named():
    assert "not all-reduced" in message(lambda: checks.check_data_parallel(*_training_results(all_reduce=False)))


def test_distributed_accuracy_mistakes_are_named():
    # 11 test samples on 2 ranks: rank 0 reads 6, rank 1 reads 5 plus one padded repeat.
    shards = {0: (5, 6, 5, 6), 1: (2, 5, 3, 6)}
    checks.check_distributed_accuracy({0: 7 / 11, 1: 7 / 11}, 7, 11, shards)
    assert "padding" in message(lambda: checks.check_distributed_accuracy({0: 8 / 12, 1: 8 / 12}, 7, 11, shards))
    assert "rank 0's shard only" in message(lambda: checks.check_distributed_accuracy({0: 5 / 6, 1: 5 / 6}, 7, 11, shards))
    assert "different accuracies" in message(lambda: checks.check_distributed_accuracy({0: 5 / 6, 1: 2 / 5}, 7, 11, shards))
    mean = (5 / 6 + 2 / 5) / 2
    assert "mean of the ranks' accuracies" in message(lambda: checks.check_distributed_accuracy({0: mean, 1: mean}, 7, 11, shards))
