"""Exercise check for chapter 04, exercise 2: pipelined training epochs over DataLoaders
with ScheduleGPipe, and evaluation with the schedule's forward-only ``eval()``.

:func:`check_pipeline_training` replays, in one process, what a correct two-stage run
computes from the batches the worker's ranks actually read, and compares the trained
weights and the evaluation with it. The worker records which samples each rank read and
whether its stage module was in training mode at every forward, so that a wrong answer
can be named.
"""

from __future__ import annotations



from ._common import CheckFailed, Mistake, launch_reports, name_the_first, passed


def _reference(data, order, config, threads, devices):
    """The two stages in one process, with the pipeline's arithmetic: per batch, each
    micro-batch's forward through stage 0 then stage 1, the backward of its mean loss
    (gradients accumulate in micro-batch order, as GPipe's do), the sum divided by the
    number of micro-batches (the schedule's scale_grads), then SGD. Each stage on the device
    its rank used, with the worker's thread count and, on a GPU, runtime.setup's full
    float32 and deterministic kernels: the same kernels give the same floats, so the
    weights can be compared bit for bit on a GPU node as on a laptop."""
    import torch

    from ..runtime import rank_arithmetic

    with rank_arithmetic(threads):
        return _replay(data, order, config, [torch.device(d) for d in devices])


def _replay(data, order, config, devices):
    import torch
    import torch.nn.functional as F

    from ..models import Net, split_net

    train_x, train_y, test_x, test_y = data
    batch, m = config["batch"], config["microbatches"]
    first, last = devices
    torch.manual_seed(0)
    stages = [stage.to(device) for stage, device in zip(split_net(Net(dropout=False)), devices)]
    params = [p for s in stages for p in s.parameters()]
    optimizer = torch.optim.SGD(params, lr=config["lr"], momentum=0.9)
    steps = len(train_y) // batch
    history = []
    for epoch in range(config["epochs"]):
        for s in stages:
            s.train()
        for step in range(steps):
            idx = order[(epoch * steps + step) * batch:(epoch * steps + step + 1) * batch]
            x, y = train_x[idx].to(first), train_y[idx].to(last)
            optimizer.zero_grad()
            for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
                out = stages[0](xb)
                act = out.detach().to(last).requires_grad_()
                F.nll_loss(stages[1](act), yb).backward()
                out.backward(act.grad.to(first))
            for p in params:
                p.grad.div_(m)
            optimizer.step()
        for s in stages:
            s.eval()
        losses, sizes, correct = [], [], 0
        with torch.no_grad():
            for start in range(0, len(test_y), batch):
                x, y = test_x[start:start + batch].to(first), test_y[start:start + batch].to(last)
                outputs = [stages[1](stages[0](xb).to(last)) for xb in x.tensor_split(m)]  # per micro-batch
                losses.append([F.nll_loss(o, yb).item() for o, yb in zip(outputs, y.tensor_split(m))])
                sizes.append([len(c) for c in y.tensor_split(m)])
                correct += (torch.cat(outputs).argmax(dim=1) == y).sum().item()
        history.append({"losses": losses, "sizes": sizes, "accuracy": correct / len(test_y)})
    return [{k: v.cpu() for k, v in s.state_dict().items()} for s in stages], history


# Why a rank failed, told by its error: the functions left as stubs, or step() where eval() belongs.
ERROR_MISTAKES = (
    Mistake("stubs left", lambda error: "NotImplementedError" in error,
             "some functions still raise NotImplementedError: fill them in."),
    Mistake("step() under no_grad", lambda error: "no_grad" in error,
             "evaluate() called schedule.step() under torch.no_grad(): step() runs the "
             "backward too, and refuses. Use schedule.eval(...), with the same arguments: "
             "forwards only."),
)


def _results(launched: dict, functions: str) -> tuple[dict, dict]:
    """Ranks 0 and 1 (the two stages) both reported a run of ``functions``: theirs, in rank order."""
    ranks = sorted(launched)
    if ranks != [0, 1] or any(functions not in launched[r].get("runs", {}) for r in ranks):
        raise CheckFailed(f"expected a report on {functions!r} from ranks 0 and 1: did the script run to the end?")
    return launched[0]["runs"][functions], launched[1]["runs"][functions]


def _check_ran(results: tuple) -> None:
    """Both stages ran the functions to the end without an error."""
    for r, result in enumerate(results):
        error = result["error"]
        if error is None:
            continue
        name_the_first(ERROR_MISTAKES, error)
        raise CheckFailed(f"rank {r} failed: {error}")


def _first_difference(a: list, b: list) -> str:
    at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else None
    return f" (first difference at sample {at}: rank 0 read {a[at]}, rank 1 {b[at]})" if at is not None else ""


# The stages of one pipeline process one batch, rank 0's images and rank 1's labels of the same
# samples (readings: the samples rank 0 and rank 1 read, in order, and which data).
SAMPLE_MISTAKES = (
    Mistake("a DistributedSampler between the stages", lambda a, b, kind: not set(a) & set(b),
            lambda a, b, kind: f"the two stages read disjoint {kind} samples (rank 0 {len(set(a))}, rank 1 "
                               f"{len(set(b))}, none in common): a DistributedSampler splits the data between "
                               "data-parallel replicas. The stages of ONE pipeline process the same batch: give both "
                               "ranks the whole dataset."),
    Mistake("the stages in different orders", lambda a, b, kind: a != b,
            lambda a, b, kind: f"the two stages walked through the {kind} data in different orders"
                               f"{_first_difference(a, b)}: rank 1 scored rank 0's images with the labels of other "
                               "samples. Shuffle both loaders with the same generator seed on every rank (not the "
                               "rank, not the global RNG after rank-dependent code)."),
)


def _check_same_samples(a: list, b: list, kind: str) -> None:
    name_the_first(SAMPLE_MISTAKES, a, b, kind)


# A stage module in the wrong mode (readings: the rank, the phase, whether it was training).
MODE_MISTAKES = (
    Mistake("train mode not restored", lambda r, phase, training: phase.startswith("training") and not training,
            lambda r, phase, training: f"rank {r}'s stage module was in eval mode during {phase}: evaluate() "
                                       "switched it with module.eval() and train_epoch() never switched it back "
                                       "(dropout and batch norm behave differently in the two modes; Hint 1)."),
    Mistake("dropout on in evaluation", lambda r, phase, training: phase.startswith("evaluation") and training,
            lambda r, phase, training: f"rank {r}'s stage module was in training mode during {phase}: the module "
                                       "you gave the PipelineStage (its submod) must evaluate with dropout off "
                                       "(Hint 1)."),
)


def _check_modes(results: tuple) -> None:
    """Each stage module was in training mode at every training forward, in eval mode at every
    evaluation forward."""
    for r, result in enumerate(results):
        for phase, training in result["modes"]:
            name_the_first(MODE_MISTAKES, r, phase, training)


def _check_weights(launched: dict, results: tuple, data_file) -> list:
    """After training, each stage's weights equal, bit for bit, those of one process training
    the same stages on the same batches. Returns that process's evaluation history."""
    import torch

    config = results[0]["config"]
    data = torch.load(data_file)
    # "cpu" for a worker that did not say: it ran before reports carried the device
    devices = [launched[r].get("device", "cpu") for r in (0, 1)]
    states, history = _reference(data, results[0]["train_order"], config, launched[0]["threads"], devices)
    for r, result in enumerate(results):
        for key, want in states[r].items():
            name_the_first((ANOTHER_STEP,), r, key, result["state"][key], want)
    return history


# A stage's weights after training that one process's do not equal (readings: the stage, the
# weight's name, its value, one process's).
ANOTHER_STEP = Mistake(
    "another training step", lambda r, key, got, want: not _torch_equal(got, want),
    lambda r, key, got, want: f"after training, stage {r}'s {key} differs from one process trained on the same "
                              f"batches (largest difference {(got - want).abs().max().item():.3g}): each batch is one "
                              "step of the optimizer from freshly zeroed gradients (Hint 3).")


def _torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _test_loss(want: dict) -> float:
    """The mean loss per test sample: each micro-batch's mean loss weighted by its size."""
    count = sum(sum(s) for s in want["sizes"])
    return sum(l * s for ls, ss in zip(want["losses"], want["sizes"]) for l, s in zip(ls, ss)) / count


def _first_microbatch_loss(want: dict) -> float:
    """The first micro-batch's mean loss of each batch, counted for the whole batch."""
    count = sum(sum(s) for s in want["sizes"])
    return sum(ls[0] * sum(ss) for ls, ss in zip(want["losses"], want["sizes"])) / count


def _unweighted_loss(want: dict) -> float:
    """The micro-batches' mean losses added up, and divided by the number of samples."""
    count = sum(sum(s) for s in want["sizes"])
    return sum(sum(ls) for ls in want["losses"]) / count


def _agrees(loss: float, mean: float) -> bool:
    """Whether a reported test loss is ``mean``, up to the rounding of float32 losses."""
    # the micro-batch losses are float32 (relative rounding 2**-24); summed in any order
    # and any precision they stay within 1e-6 of the reference, and every mistake named
    # below moves the mean by 1e-3 or more.
    return abs(loss - mean) <= 1e-6 * abs(mean)


# Which wrong mean the reported test loss is, told by recomputing that mean from the
# replay's micro-batch losses.
LOSS_MISTAKES = (
    Mistake("first micro-batch only", lambda loss, want: _agrees(loss, _first_microbatch_loss(want)),
             "that is the first micro-batch's loss of each batch counted for the "
             "whole batch. eval() fills `losses` with one loss per micro-batch: use all "
             "of them."),
    Mistake("unweighted mean", lambda loss, want: _agrees(loss, _unweighted_loss(want)),
             "you added the micro-batch losses, each a MEAN over its own samples, "
             "and divided by the number of samples: weight each by its micro-batch's "
             "size."),
)


def _check_test_loss(epoch: int, loss: float, want: dict) -> None:
    """The test loss after ``epoch`` is the mean loss per test sample."""
    right = _test_loss(want)
    if not abs(loss - right) <= 1e-6 * abs(right):  # beyond float32 rounding (see _agrees), or NaN
        where = f"after epoch {epoch}: test loss {loss:.6g}, expected {right:.6g}: "
        name_the_first(LOSS_MISTAKES, loss, want, before=where)
        raise CheckFailed(where + "weight each micro-batch's mean loss by its samples, sum over the test "
                          "set, divide by the number of test samples.")


NOTHING_RETURNED = Mistake(
    "nothing returned", lambda got, epochs: len(got) != epochs or any(h is None for h in got),
    lambda got, epochs: f"evaluate() returned {got!r} on the last stage after each epoch: return (mean loss per "
                        "sample, accuracy).")
# a count of right answers over the test set's size: any honest way of computing it agrees to a
# rounding (1e-16), and one answer more or less moves it by 1/len(test)
ANOTHER_ACCURACY = Mistake(
    "accuracy not over the whole test set", lambda epoch, accuracy, want: not abs(accuracy - want) <= 1e-12,  # or NaN
    lambda epoch, accuracy, want: f"after epoch {epoch}: accuracy {accuracy}, expected {want}: the last stage's "
                                  "eval() returns the whole batch's output; compare its argmax with the labels, over "
                                  "all the test set.")


def _check_evaluation(got: list, history: list, config: dict) -> None:
    """After each epoch, the last stage's evaluate() returned the mean test loss per sample and
    the accuracy over the whole test set."""
    name_the_first((NOTHING_RETURNED,), got, config["epochs"])
    for epoch, ((loss, accuracy), want) in enumerate(zip(got, history), start=1):
        _check_test_loss(epoch, loss, want)
        name_the_first((ANOTHER_ACCURACY,), epoch, accuracy, want["accuracy"])


def check_pipeline_training(launched, data_file, functions: str = "pipeline_functions") -> None:
    """Check what pipeline_epochs.py reported (``launch(...).reports``) for the module
    ``functions`` against one process training the same stages on the same batches;
    ``data_file`` is the data it trained on."""
    launched = launch_reports(launched, f"the functions in {functions}.py")  # a launch (check=False) or its reports
    results = _results(launched, functions)
    first, last = results
    _check_ran(results)
    _check_same_samples(first["train_order"], last["train_order"], "training")
    _check_same_samples(first["test_order"], last["test_order"], "test")
    _check_modes(results)
    history = _check_weights(launched, results, data_file)
    got = last["history"]
    _check_evaluation(got, history, first["config"])
    passed(f"{first['config']['epochs']} pipelined epochs: both stages read the same batches, the weights equal "
           f"one process's exactly, and the evaluation (test loss {got[-1][0]:.4f}, accuracy {got[-1][1]:.3f}) "
           "is right")
