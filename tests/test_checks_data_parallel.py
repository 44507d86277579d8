"""The checks of chapters 02 and 03 pass right answers and name the mistake in wrong ones;
chapter 03's exercise 1 with its mistakes planted in a copy of the solution's worker."""

import math
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

import spike_course
from spike_course import checks, data, models, workers
from spike_course.checks import CheckFailed
from spike_course.launcher import LaunchResult


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


def test_a_faithful_copy_passes():
    checks.check_sampler(GoodSampler)


class Inherits(DistributedSampler):
    pass


@pytest.mark.parametrize("sampler", [DistributedSampler, Inherits])
def test_torchs_own_order_is_not_an_answer(sampler):
    """`MySampler = DistributedSampler`, or a subclass that adds nothing: the trivial answers."""
    assert "inherits __iter__ and __len__ from torch's DistributedSampler" in message(
        lambda: checks.check_sampler(sampler))


@pytest.mark.parametrize("sampler", [IgnoresRank, OwnSeedPerRank])
def test_overlapping_ranks_are_named(sampler):
    assert "ranks overlap" in message(lambda: checks.check_sampler(sampler))


@pytest.mark.parametrize("sampler", [NoSetEpoch, IgnoresEpoch])
def test_a_missing_set_epoch_is_named(sampler):
    assert "set_epoch" in message(lambda: checks.check_sampler(sampler))


def test_uneven_shards_are_named():
    assert "every rank must read exactly" in message(lambda: checks.check_sampler(UnevenShards))


def _training_results(world_size=2, sum_only=False, broadcast=True, all_reduce=True):
    """Made-up reports of exercise 1's worker: each rank's initial weights, first-step gradients
    (its own and averaged, by one all-reduce) and final weights, and the one-process reference."""
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
        ranks[rank] = {"initial": start, "grads": g, "final": {k: start[k] - 0.1 * g[k] for k in start},
                       "local": {k: v + 1 + rank for k, v in grads.items()}, "collectives": {"allreduce_": 1}}
    return ranks, reference


def test_right_data_parallel_passes():
    checks.check_flat_allreduce(*_training_results())


def test_summed_not_averaged_is_named():
    text = message(lambda: checks.check_flat_allreduce(*_training_results(sum_only=True)))
    assert "summed but not averaged" in text and "world size" in text


def test_missing_broadcast_is_named():
    text = message(lambda: checks.check_flat_allreduce(*_training_results(broadcast=False)))
    assert "not broadcast" in text


def test_missing_all_reduce_is_named():
    assert "not all-reduced" in message(lambda: checks.check_flat_allreduce(*_training_results(all_reduce=False)))


def test_distributed_accuracy_mistakes_are_named():
    # 11 test samples on 2 ranks: rank 0 reads 6, rank 1 reads 5 plus one padded repeat.
    shards = {0: (5, 6, 5, 6), 1: (2, 5, 3, 6)}
    checks.check_distributed_accuracy({0: 7 / 11, 1: 7 / 11}, 7, 11, shards)
    assert "padding" in message(lambda: checks.check_distributed_accuracy({0: 8 / 12, 1: 8 / 12}, 7, 11, shards))
    assert "rank 0's shard only" in message(lambda: checks.check_distributed_accuracy({0: 5 / 6, 1: 5 / 6}, 7, 11, shards))
    assert "different accuracies" in message(lambda: checks.check_distributed_accuracy({0: 5 / 6, 1: 2 / 5}, 7, 11, shards))
    mean = (5 / 6 + 2 / 5) / 2
    assert "mean of the ranks' accuracies" in message(lambda: checks.check_distributed_accuracy({0: mean, 1: mean}, 7, 11, shards))


# --- chapter 03, exercise 1: one all-reduce per step, planted mistakes launched for real ---

ROOT = Path(__file__).resolve().parents[1]
FLAT_WORKER = "workers/03_data_parallel/average_by_hand.py"
BEGIN, END = "    ### BEGIN SOLUTION\n", "    ### END SOLUTION\n"
PER_PARAMETER = """\
    for p in model.parameters():  # the lecture's loop: right values, one collective per parameter
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()
"""
REBOUND = """\
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g = part.view_as(g)  # rebinds the loop variable: no .grad changes
"""


def _solution_worker() -> str:
    notebook = nbformat.read(ROOT / "solutions" / "03_data_parallel.ipynb", as_version=4)
    cell = next(c.source for c in notebook.cells if c.source.startswith(f"%%writefile {FLAT_WORKER}"))
    return cell.split("\n", 1)[1]


def _planted(region=None, drop=None) -> str:
    """The solution's worker with its region replaced by ``region``, or with the line ``drop`` removed."""
    source = _solution_worker()
    if drop is not None:
        assert drop in source
        return source.replace(drop, "")
    begin, end = source.index(BEGIN), source.index(END)
    return source[:begin] + region + source[end + len(END):]


def _one_process(batch=16, steps=3, lr=0.05, world=2):
    """What notebook cell 5 computes: one process, rank 0's start, the two ranks' batches at once."""
    train_set = data.load_mnist(train=True, limit=batch * steps * world)
    torch.manual_seed(100)
    model = models.Net(dropout=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    reference = {"initial": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for step in range(steps):
        samples = [train_set[i] for i in range(step * world * batch, (step + 1) * world * batch)]
        x, y = torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        if step == 0:
            reference["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
    reference["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return reference


@pytest.fixture(scope="module")
def one_process():
    return _one_process()


@pytest.mark.processes
def test_the_solution_passes_with_one_allreduce(worker, no_orphans, one_process, capsys):
    job = spike_course.launch(worker(_solution_worker()), nproc=2, echo=False, progress=False, timeout=120)
    assert [job.reports[r]["collectives"] for r in range(2)] == [{"allreduce_": 1}] * 2
    checks.check_flat_allreduce(job, one_process)
    assert "one all-reduce per step" in capsys.readouterr().out


@pytest.mark.parametrize("planted, expected", [
    (dict(region=PER_PARAMETER), "8 all-reduces in one step .* flatten into one buffer"),
    (dict(region=REBOUND), "never copied back into .grad"),
    (dict(drop="    flat /= dist.get_world_size()\n"), "summed but not averaged: they are 2 times too big"),
    (dict(drop="        offset += g.numel()\n"), "slices are misaligned: conv1.bias.grad"),
], ids=["one-allreduce-per-parameter", "not-copied-back", "not-divided", "offset-not-advanced"])
@pytest.mark.processes
def test_planted_mistakes_are_named(planted, expected, worker, no_orphans, one_process):
    job = spike_course.launch(worker(_planted(**planted)), nproc=2, echo=False, progress=False, timeout=120)
    assert job.ok, job.output
    with pytest.raises(CheckFailed, match=expected):
        checks.check_flat_allreduce(job, one_process)


def test_a_blank_or_crashed_worker_is_named():
    blank = LaunchResult(nproc=2, returncodes={0: 1, 1: 1}, output={
        0: ["Traceback (most recent call last):",
            'NotImplementedError: exercise: replace this line with your code'], 1: []})
    with pytest.raises(CheckFailed, match="not written yet"):
        checks.check_flat_allreduce(blank, {})
    crashed = LaunchResult(nproc=2, returncodes={0: 0, 1: 1}, reports={0: {}}, output={
        0: [], 1: ["RuntimeError: shape '[32]' is invalid for input of size 288"]})
    with pytest.raises(CheckFailed, match="rank 1 failed .*shape"):
        checks.check_flat_allreduce(crashed, {})


# --- chapter 03, exercise 2: the evaluation is split between the ranks ---

def test_an_evaluation_that_every_rank_runs_whole_is_named():
    shards = {0: (5, 6, 5, 6), 1: (2, 5, 3, 6)}
    # the right value, but each rank ran the model on all 11 samples: nothing was distributed
    text = message(lambda: checks.check_distributed_accuracy({0: 7 / 11, 1: 7 / 11}, 7, 11, shards, {0: 11, 1: 11}))
    assert "rank 0 ran the model on 11 test samples" in text and "not split" in text
    assert "never evaluated" in message(
        lambda: checks.check_distributed_accuracy({0: 7 / 11, 1: 7 / 11}, 7, 11, shards, {0: 6, 1: 0}))
    checks.check_distributed_accuracy({0: 7 / 11, 1: 7 / 11}, 7, 11, shards, {0: 6, 1: 6})  # padding included


WHOLE_TEST_SET = '''def evaluate(model, dataset, device, batch_size=100):
    """Every rank evaluates everything: the right number, and no distribution at all."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):
            correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    model.train()
    return correct / len(dataset)


'''


@pytest.mark.processes
def test_the_trivial_whole_test_set_answer_fails_for_real(worker, no_orphans):
    notebook = nbformat.read(ROOT / "solutions" / "03_data_parallel.ipynb", as_version=4)
    source = workers.worker_cells(notebook)["03_data_parallel/evaluate.py"]
    planted = source[:source.index("def evaluate(")] + WHOLE_TEST_SET + source[source.index("def shard_counts("):]
    total = 101
    job = spike_course.launch(worker(planted), nproc=2, args=["--test-samples", total, "--train-steps", 2],
                              echo=False, progress=False, timeout=120)
    reports = job.reports
    correct = round(reports[0]["accuracy"] * total)
    assert reports[0]["accuracy"] == correct / total  # the value alone would pass
    text = message(lambda: checks.check_distributed_accuracy(
        {r: reports[r]["accuracy"] for r in range(2)}, correct, total,
        {r: reports[r]["shard"] for r in range(2)}, {r: reports[r]["evaluated"] for r in range(2)}))
    assert f"ran the model on {total} test samples" in text


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


def test_a_valid_partition_that_is_not_torchs_says_which_part_differs():
    text = message(lambda: checks.check_sampler(Blocks))
    assert "cut between the ranks another way" in text
    assert "rank:total_size" not in text and "randperm" not in text  # a mistake named, not the recipe
