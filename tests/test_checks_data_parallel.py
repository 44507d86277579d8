"""The checks of chapter 03 pass right answers and name the mistake in wrong ones; its
exercises with their mistakes planted in a copy of the solution's worker (one
launch of 2 ranks per mistake of exercise 1; one launch for all of exercise 2's)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import spike_course
from spike_course import checks, data, models
from spike_course.checks import CheckFailed, ch03_data_parallel as data_parallel
from named import mistake_of, names
from spike_course.lab.launcher import LaunchResult
from spike_course.course import conventions
from spike_course.course.conventions import written_file
from planting import one_launch_for_all, planted, replace_region

import course_files


def message(call) -> str:
    with pytest.raises(checks.CheckFailed) as info:
        call()
    return str(info.value)


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


def _each_rank(change):
    def plant(ranks, reference):
        for rank, got in ranks.items():
            change(rank, got, reference)
    return plant


def _no_collective(rank, got, reference):
    got["local"], got["collectives"] = got["grads"], {}


def _w_kept(rank, got, reference):
    got["local"] = {**got["local"], "w": got["grads"]["w"]}


def _another_start(rank, got, reference):
    got["initial"] = {k: v + 0.5 for k, v in reference["initial"].items()}


def _divided_twice(rank, got, reference):
    got["grads"] = {k: v / 2 for k, v in got["grads"].items()}


def _first_step_only(rank, got, reference):
    got["final"] = {k: v + 0.1 for k, v in got["final"].items()}


def _also_a_broadcast(rank, got, reference):
    got["collectives"] = {"allreduce_": 1, "broadcast_": 1}


# A mistake of exercise 1's tables -> the made-up reports that show it (2 ranks), what is said.
FLAT_REPORTED = {
    "summed, not averaged": (dict(sum_only=True), None, "summed but not averaged.*world size"),
    "weights not broadcast": (dict(broadcast=False), None, "not broadcast"),
    "gradients not all-reduced": (dict(all_reduce=False), None, "not all-reduced"),
    "no collective": ({}, _each_rank(_no_collective), "made no collective: rank 0's gradients are its own"),
    "some gradients not copied back": ({}, _each_rank(_w_kept), "only some gradients were copied back.*rank 0's w"),
    "broadcast from another rank": ({}, _each_rank(_another_start), "but not rank 0's"),
    "divided twice": ({}, _each_rank(_divided_twice), "1/2 of the single-process gradient"),
    "the first step only": ({}, _each_rank(_first_step_only), "average the gradients in EVERY step"),
    "other collectives": ({}, _each_rank(_also_a_broadcast), "made 1 allreduce, 1 broadcast in one step"),
}


@pytest.mark.parametrize("name", FLAT_REPORTED)
def test_a_mistake_in_the_reports_of_exercise_1_is_named(name):
    options, change, says = FLAT_REPORTED[name]
    ranks, reference = _training_results(**options)
    if change:
        change(ranks, reference)
    with names(name, says=says):
        checks.check_flat_allreduce(ranks, reference)


# --- chapter 03, exercise 1: one all-reduce per step, planted mistakes launched for real ---

ROOT = Path(__file__).resolve().parents[1]
FLAT_WORKER = "workers/03_data_parallel/average_by_hand.py"
BEGIN, END = f"    {conventions.BEGIN}\n", f"    {conventions.END}\n"  # the workers' regions are in a function
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
    notebook = course_files.notebook(ROOT / "solutions" / "03_data_parallel.ipynb")
    return written_file(notebook, FLAT_WORKER)


def _planted(region=None, drop=None) -> str:
    """The solution's worker with its region replaced by ``region``, or with the line ``drop`` removed."""
    source = _solution_worker()
    if drop is not None:
        assert drop in source
        return source.replace(drop, "")
    return replace_region(source, 0, region, regions=1)


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


FLAT_PLANTED = {  # a mistake of exercise 1's tables -> the planted worker, what is said
    "one all-reduce per parameter": (dict(region=PER_PARAMETER),
                                     "8 all-reduces in one step .* flatten into one buffer"),
    "the buffer never copied back": (dict(region=REBOUND), "never copied back into .grad"),
    "summed, not averaged": (dict(drop="    flat /= dist.get_world_size()\n"),
                             "summed but not averaged: they are 2 times too big"),
    "slices misaligned": (dict(drop="        offset += g.numel()\n"), "slices are misaligned: conv1.bias.grad"),
}


CHECK_MODULE = data_parallel  # tests/named.py; PLANTS below


@pytest.mark.parametrize("name", FLAT_PLANTED)
@pytest.mark.processes
def test_planted_mistakes_are_named(name, worker, no_orphans, one_process):
    planted, says = FLAT_PLANTED[name]
    job = spike_course.launch(worker(_planted(**planted)), nproc=2, echo=False, progress=False, timeout=120)
    assert job.ok, job.output
    with names(name, says=says):
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


# --- chapter 03, exercise 2: an evaluation split between the ranks, mistakes planted in the solution ---

EVALUATE = "workers/03_data_parallel/evaluate.py"
# 301 samples on 2 ranks: shards of 151 and 150 (+ one repeat), in batches of 100 and 51.
TEST = 301
EVALUATE_ARGS = ["--test-samples", TEST]
RIGHT_LINE = "real = torch.arange(counted, counted + len(y), device=device) < real_here"
ALL_REDUCE_LINE = "dist.all_reduce(sums)  # one message; every rank now holds the whole test set's sums"
RATIOS_AVERAGED = """\
    loss_sum, right, seen = sums[0], sums[1:1 + num_classes], sums[1 + num_classes:]
    ratios = torch.cat([(loss_sum / seen.sum()).view(1), (right.sum() / seen.sum()).view(1), right / seen])
    dist.all_reduce(ratios, op=dist.ReduceOp.AVG)  # the mean of the ranks' own ratios
    return {"loss": ratios[0].item(), "accuracy": ratios[1].item(), "recall": ratios[2:].tolist()}
"""
RECALL_AVERAGED = """\
    message = torch.cat([sums, sums[1:1 + num_classes] / sums[1 + num_classes:]])  # and this rank's recalls
    dist.all_reduce(message)
    loss_sum, right, seen = message[0], message[1:1 + num_classes], message[1 + num_classes:1 + 2 * num_classes]
    return {"loss": (loss_sum / seen.sum()).item(), "accuracy": (right.sum() / seen.sum()).item(),
            "recall": (message[1 + 2 * num_classes:] / dist.get_world_size()).tolist()}
"""
WHOLE_TEST_SET = """\
    model.eval()
    sums = torch.zeros(1 + 2 * num_classes, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):  # everything, on every rank
            log_probs, y = model(x.to(device)).double(), y.to(device)
            sums[0] += F.nll_loss(log_probs, y, reduction="sum")
            sums[1:1 + num_classes] += torch.bincount(y[log_probs.argmax(1) == y], minlength=num_classes)
            sums[1 + num_classes:] += torch.bincount(y, minlength=num_classes)
    loss_sum, right, seen = sums[0], sums[1:1 + num_classes], sums[1 + num_classes:]
    return {"loss": (loss_sum / seen.sum()).item(), "accuracy": (right.sum() / seen.sum()).item(),
            "recall": (right / seen).tolist()}
"""
NOTHING_RUN = '    return {"loss": 0.0, "accuracy": 0.0, "recall": [0.0] * num_classes}\n'
# Issue 40's audit: the shard through model() for the hook, the whole test set past it through
# model.forward, and one all-reduce of nothing for the count of collectives.
PAST_THE_HOOK = """\
    model.eval()
    sums = torch.zeros(1 + 2 * num_classes, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, _ in DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, shuffle=False)):
            model(x.to(device))
        for x, y in DataLoader(dataset, batch_size=batch_size):
            log_probs, y = model.forward(x.to(device)).double(), y.to(device)
            sums[0] += F.nll_loss(log_probs, y, reduction="sum")
            sums[1:1 + num_classes] += torch.bincount(y[log_probs.argmax(1) == y], minlength=num_classes)
            sums[1 + num_classes:] += torch.bincount(y, minlength=num_classes)
    dist.all_reduce(torch.zeros(1, device=device))
    loss_sum, right, seen = sums[0], sums[1:1 + num_classes], sums[1 + num_classes:]
    return {"loss": (loss_sum / seen.sum()).item(), "accuracy": (right.sum() / seen.sum()).item(),
            "recall": (right / seen).tolist()}
"""


def _evaluation(*changes, region=None, start=BEGIN) -> str:
    """The solution's evaluate.py with ``changes`` (old, new) made in its solution region, or with
    the region from its line that starts with ``start`` to its end replaced by ``region``."""
    source = written_file(course_files.notebook(ROOT / "solutions" / "03_data_parallel.ipynb"), EVALUATE)
    if region is not None:
        begin = source.index(start, source.index(BEGIN)) + (len(BEGIN) if start == BEGIN else 0)
        source = source[:begin] + region + source[source.index(END):]
    return planted(source, *changes)


@pytest.fixture(scope="module")
def test_set():
    dataset = data.load_mnist(train=False, limit=TEST)
    return torch.stack([dataset[i][0] for i in range(TEST)]), torch.tensor([dataset[i][1] for i in range(TEST)])


def _check(reports, test_set):
    """What the notebook's check cell does with the ranks' reports, on the test's smaller test set."""
    model = models.Net()
    model.load_state_dict(reports[0]["weights"])
    model.eval()
    images, labels = test_set
    with torch.no_grad():
        log_probs = model(images)
    checks.check_distributed_accuracy(reports, images, labels, log_probs)


LOSS_LINE = 'sums[0] += F.nll_loss(log_probs, y, reduction="sum")'
LOSS_RETURNED = '"loss": (loss_sum / seen.sum())'
# Issue 41's plants of the combined mistakes: the recall's counts made with the repeats in
# (accuracy and loss right), then averaged over the ranks or pooled as a precision.
REPEATS_IN_RECALL = """\
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    real_here = len(range(sampler.rank, len(dataset), sampler.num_replicas))
    sums = torch.zeros(1 + 2 * num_classes, dtype=torch.float64, device=device)
    every = torch.zeros(2 * num_classes, dtype=torch.float64, device=device)  # the recall's counts, repeats in
    counted = 0
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            log_probs, y = model(x.to(device)).double(), y.to(device)
            every[:num_classes] += torch.bincount(y[log_probs.argmax(1) == y], minlength=num_classes)
            every[num_classes:] += {recall_counts}
            real = torch.arange(counted, counted + len(y), device=device) < real_here
            counted += len(y)
            log_probs, y = log_probs[real], y[real]
            sums[0] += F.nll_loss(log_probs, y, reduction="sum")
            sums[1:1 + num_classes] += torch.bincount(y[log_probs.argmax(1) == y], minlength=num_classes)
            sums[1 + num_classes:] += torch.bincount(y, minlength=num_classes)
{message}
    loss_sum, right, seen = message[0], message[1:1 + num_classes], message[1 + num_classes:1 + 2 * num_classes]
    return {{"loss": (loss_sum / seen.sum()).item(), "accuracy": (right.sum() / seen.sum()).item(),
            "recall": recall.tolist()}}
"""
RECALL_COUNTS = "torch.bincount(y, minlength=num_classes)"
PRECISION_COUNTS = "torch.bincount(log_probs.argmax(1), minlength=num_classes)"
RANKS_RECALL = """\
    message = torch.cat([sums, every[:num_classes] / every[num_classes:]])  # and this rank's own recalls
    dist.all_reduce(message)
    recall = message[1 + 2 * num_classes:] / dist.get_world_size()"""
POOLED_RECALL = """\
    message = torch.cat([sums, every])
    dist.all_reduce(message)
    recall = message[1 + 2 * num_classes:1 + 3 * num_classes] / message[1 + 3 * num_classes:]"""


PLANTED = {  # a copy of the solution with one mistake -> what the check must say
    "repeats counted": (
        lambda: _evaluation((RIGHT_LINE, "real = torch.ones(len(y), dtype=torch.bool, device=device)")),
        r"accuracy is .*counts the 1 repeat\(s\) that DistributedSampler added .*302 samples counted, the test "
        r"set has 301.*\(Hint 1\)"),
    "ratios of the ranks averaged": (
        lambda: _evaluation(region=RATIOS_AVERAGED, start="    dist.all_reduce(sums)"),
        r"accuracy is .*mean of the ranks' own accuracy values, but the shards differ in size \(151 and 150 real"),
    "ratios of the ranks averaged (the loss)": (  # each rank's mean loss, summed with the counts, then halved
        lambda: _evaluation((LOSS_LINE, LOSS_LINE + " / real_here"),
                            (LOSS_RETURNED, '"loss": (loss_sum / dist.get_world_size())')),
        r"the loss is .*mean of the ranks' own loss values, but the shards differ in size \(151 and 150 real "
        r"samples\), so"),
    "ratios of the ranks averaged (the recall)": (
        lambda: _evaluation(region=RECALL_AVERAGED, start="    dist.all_reduce(sums)"),
        r"recall of class \d is .*mean of the ranks' own recall values, .*each class a different number"),
    "mean of batch means": (
        lambda: _evaluation((LOSS_LINE, "sums[0] += F.nll_loss(log_probs, y)"),
                            (LOSS_RETURNED, '"loss": (loss_sum / (len(loader) * dist.get_world_size()))')),
        r"loss is .*mean of the per-batch loss values, but the batches differ in size \(100 and 51 samples\)"),
    "precision for recall": (
        lambda: _evaluation(("torch.bincount(y, minlength=num_classes)",
                             "torch.bincount(log_probs.argmax(1), minlength=num_classes)")),
        r"recall of class \d is .*PREDICTED as that class, which is the class's precision"),
    "the whole test set on every rank": (
        lambda: _evaluation(region=WHOLE_TEST_SET),
        r"rank 0 ran the model on all 301 test samples: every rank evaluated the whole test set"),
    "more than one collective in evaluate": (
        lambda: _evaluation((ALL_REDUCE_LINE, "for part in (sums[:1], sums[1:1 + num_classes], "
                                              "sums[1 + num_classes:]):\n        dist.all_reduce(part)")),
        r"the results are right, but rank 0's evaluate made 3 collectives \(3 allreduce\)"),
    "dropout on": (
        lambda: _evaluation(("    model.eval()  # dropout off\n", "")),
        r"rank 0 ran the model in training mode during evaluate: dropout"),
    "past the model's hook": (
        lambda: _evaluation(region=PAST_THE_HOOK),
        r"rank 0's network ran on 452 samples during evaluate, but only 151 of them went through the model"),
    "part of the shard never run": (
        lambda: _evaluation(region=NOTHING_RUN),
        r"rank 0's model never ran on 151 of the 151 samples of its shard"),
    "another split": (lambda: _evaluation(("DistributedSampler(dataset, shuffle=False)",
                                           "DistributedSampler(dataset, shuffle=True, seed=1)")),
                      r"rank 0 ran the model on \d+ samples of other ranks' shards"),
    "repeats counted and ratios of the ranks averaged": (
        lambda: _evaluation(region=REPEATS_IN_RECALL.format(recall_counts=RECALL_COUNTS, message=RANKS_RECALL)),
        r"recall of class \d is .*counts the 1 repeat\(s\).*; and it is the mean of the ranks' own recall values"),
    "repeats counted and precision for recall": (
        lambda: _evaluation(region=REPEATS_IN_RECALL.format(recall_counts=PRECISION_COUNTS, message=POOLED_RECALL)),
        r"recall of class \d is .*counts the 1 repeat\(s\).*; and each class's value divides .*PREDICTED"),
    "repeats counted and mean of batch means": (
        lambda: _evaluation(("log_probs, y = log_probs[real], y[real]\n", "sums[0] += F.nll_loss(log_probs, y)  # "
                             "a batch's mean, its repeat in it\n            log_probs, y = log_probs[real], y[real]\n"),
                            (LOSS_LINE, "pass"),
                            (LOSS_RETURNED, '"loss": (loss_sum / (len(loader) * dist.get_world_size()))')),
        r"loss is .*counts the 1 repeat\(s\).*; and it is the mean of the per-batch loss values"),
}


def test_a_counting_hook_taken_away_is_named():
    """evaluate could clear the first layer's hook and then run the test set past the model's:
    a first layer that counted fewer rows than the model ran on is named, not trusted."""
    ran = [(torch.zeros(151, 1, 28, 28), torch.zeros(151, 10), False)]
    rank = {"result": {"loss": 0.0, "accuracy": 0.0, "recall": [0.0] * 10}, "forwards": ran,
            "first_layer_rows": 0, "collectives": {}}
    with names("the counting hook taken away",
               says=r"rank 0's model ran on 151 samples .* counted only 0: evaluate removed"):
        checks.check_distributed_accuracy({0: rank}, torch.zeros(1), torch.zeros(1), torch.zeros(1, 10))


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    """The solution's evaluate() and every planted one, run in one launch of 2 ranks on the
    same trained model, each handed it in training mode (as the worker does): {name: {rank: report}}."""
    sources = {"solution": _evaluation(), **{name: source() for name, (source, _) in PLANTED.items()}}
    script = tmp_path_factory.mktemp("evaluate") / "evaluate.py"
    script.write_text(one_launch_for_all(sources, "evaluate", loop_from="forwards = []",
                                         before_each="model.train()"))
    job = spike_course.launch(str(script), nproc=2, args=EVALUATE_ARGS, echo=False, progress=False, timeout=120)
    return {name: {rank: job.reports[rank][name] for rank in job.reports} for name in sources}


@pytest.mark.processes
def test_the_evaluation_passes_with_one_allreduce(evaluations, test_set, capsys):
    _check(evaluations["solution"], test_set)
    assert [evaluations["solution"][r]["collectives"] for r in range(2)] == [{"allreduce_": 1}] * 2
    assert "the same on 2 ranks as in one process" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", PLANTED)
@pytest.mark.processes
def test_planted_evaluation_mistakes_are_named(mistake, evaluations, test_set):
    with names(mistake_of(mistake), says=PLANTED[mistake][1]):
        _check(evaluations[mistake], test_set)


PLANTS = {**FLAT_REPORTED, **FLAT_PLANTED, **PLANTED,
          "the counting hook taken away": "test_a_counting_hook_taken_away_is_named"}


FLOAT32_SUMS = (("counted = 0\n", "counted = 0\n    loss32 = torch.zeros((), dtype=torch.float32, device=device)\n"),
                (LOSS_LINE, "for value in F.nll_loss(log_probs.float(), y, reduction='none'):\n"
                            "                loss32 += value  # one by one, rounded to float32 each time"),
                (ALL_REDUCE_LINE, "sums[0] = loss32\n    " + ALL_REDUCE_LINE))


@pytest.mark.processes
def test_float32_sums_of_the_losses_stay_within_the_tolerance(worker, no_orphans, test_set, capsys):
    """Why "float32 sums" is no mistake of the check's tables: on this test set the loss summed
    one sample at a time in float32 passes, within the bound the check derives."""
    job = spike_course.launch(worker(_evaluation(*FLOAT32_SUMS)), nproc=2, args=EVALUATE_ARGS, echo=False,
                              progress=False, timeout=120)
    _check(job.reports, test_set)
    assert "check passed" in capsys.readouterr().out


def test_what_the_evaluation_returns_is_checked_first():
    lecture_copy = {"result": (0.5, [75.0, 151.0]), "forwards": [], "collectives": {"allreduce_": 1}}
    text = message(lambda: checks.check_distributed_accuracy(
        {0: lecture_copy, 1: lecture_copy}, torch.zeros(3, 1, 28, 28), torch.tensor([0, 1, 2]), torch.zeros(3, 10)))
    assert "rank 0's evaluate returned '(0.5, [75.0, 151.0])', not a dict" in text
    recall_missing = dict(lecture_copy, result={"loss": 1.0, "accuracy": 0.5, "recall": 0.5})
    text = message(lambda: checks.check_distributed_accuracy(
        {0: recall_missing, 1: recall_missing}, torch.zeros(3, 1, 28, 28), torch.tensor([0, 1, 2]), torch.zeros(3, 10)))
    assert "a recall for each of the 10 classes" in text
