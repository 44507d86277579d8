"""Chapter 04: the GPipe-by-hand check names the likely mistake; Net splits cleanly."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spike_course import checks
from spike_course.checks import ch04_pipeline as pipeline
from spike_course.models import Net, split_net
from named import mistake_of, names

import course_files

M = 4


STAGE_OF = {"conv1.weight": 0, "conv1.bias": 0, "conv2.weight": 0, "conv2.bias": 0,
            "fc1.weight": 1, "fc1.bias": 1, "fc2.weight": 1, "fc2.bias": 1}


def grads(net):
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    net = Net(dropout=False)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    F.nll_loss(net(x), y).backward()
    reference = grads(net)
    net.zero_grad()
    F.nll_loss(net(x.chunk(M)[-1]), y.chunk(M)[-1]).backward()
    last = grads(net)
    # GPipe by hand on one process, without the 1/m: the classic mistake.
    net.zero_grad()
    stage0, stage1 = split_net(net)
    for xb, yb in zip(x.chunk(M), y.chunk(M)):
        F.nll_loss(stage1(stage0(xb)), yb).backward()
    unscaled = grads(net)
    # ...and with the 1/m, but stage 0 runs its backwards in the reverse order of the sends:
    # each received gradient meets the output of another micro-batch.
    net.zero_grad()
    outputs = [stage0(xb) for xb in x.chunk(M)]
    received = [out.detach().requires_grad_() for out in outputs]
    for act, yb in zip(received, y.chunk(M)):
        (F.nll_loss(stage1(act), yb) / M).backward()
    for out, act in zip(outputs, reversed(received)):
        out.backward(act.grad)
    mispaired = grads(net)
    return reference, last, unscaled, mispaired


def check(answer, problem, **kw):
    reference, last, *_ = problem
    checks.check_pipeline_gradients(answer, reference, M, stages=STAGE_OF, last_microbatch=last, **kw)


def fails_with(answer, problem, *words):
    with pytest.raises(checks.CheckFailed) as error:
        check(answer, problem)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_split_net_composes_to_net():
    torch.manual_seed(0)
    net = Net(dropout=False)
    stage0, stage1 = split_net(net)
    x = torch.randn(3, 1, 28, 28)
    assert stage0(x).shape == (3, 9216)
    torch.testing.assert_close(stage1(stage0(x)), net(x))
    names = [n for s in (stage0, stage1) for n, _ in s.named_parameters()]
    assert names == [n for n, _ in net.named_parameters()]  # nothing lost, nothing shared twice
    assert {n: i for i, s in enumerate((stage0, stage1)) for n, _ in s.named_parameters()} == STAGE_OF


def test_right_answer_passes(problem, capsys):
    check(problem[0], problem)
    assert "check passed" in capsys.readouterr().out


# Each mistake of the check's tables: the answer, made from the problem's gradients, and words
# its message must hold.
PIPELINE_PLANTED = {
    "losses not scaled by 1/m": (lambda p: p[2], ["not scaled by 1/m", f"{M} x too large"]),
    "1/m applied twice": (lambda p: {k: v / M for k, v in p[0].items()}, ["twice"]),
    "1/m applied again on the way back": (lambda p: {k: v / M if STAGE_OF[k] == 0 else v for k, v in p[0].items()},
                                          ["stage [0]", "too small"]),
    "this stage's losses not scaled": (lambda p: {k: v * M if STAGE_OF[k] == 0 else v for k, v in p[0].items()},
                                       ["stage [0]", "too large", "not scaled by 1/m"]),
    "only the last micro-batch": (lambda p: p[1], ["only the last micro-batch"]),
    "only the last micro-batch (scaled by 1/m)": (lambda p: {k: v / M for k, v in p[1].items()},
                                                  ["only the last micro-batch"]),
}
CHECK_MODULE = pipeline  # tests/named.py; PLANTS below


@pytest.mark.parametrize("name", PIPELINE_PLANTED)
def test_each_planted_mistake_is_named(problem, name):
    answer, words = PIPELINE_PLANTED[name]
    with names(mistake_of(name)):
        check(answer(problem), problem)
    fails_with(answer(problem), problem, *words)


def test_no_gradient_across_the_boundary_named(problem):
    answer = {k: (None if STAGE_OF[k] == 0 else v) for k, v in problem[0].items()}
    with names("the boundary not crossed", says=r"no gradient reached stage \[0\].*Hint 1"):
        check(answer, problem)
    answer = {k: (torch.zeros_like(v) if STAGE_OF[k] == 0 else v) for k, v in problem[0].items()}
    with names("the boundary not crossed", says=r"no gradient reached stage \[0\]"):
        check(answer, problem)


def test_missing_gradients_on_the_last_stage_named(problem):
    answer = {k: (None if k.startswith("fc2") else v) for k, v in problem[0].items()}
    with names("no backward", says=r"no gradient for \['fc2.weight', 'fc2.bias'\].*loss.backward\(\)"):
        check(answer, problem)


def test_wrong_shape_named(problem):
    answer = {**problem[0], "fc1.weight": problem[0]["fc1.weight"].t()}
    with names("gradients of another shape", says=r"\['fc1.weight'\] have the wrong shape"):
        check(answer, problem)


def test_mismatched_pairing_named(problem):
    with names("outputs and gradients of different micro-batches",
               says=r"stage \[0\] has wrong gradients.*same micro-batch"):
        check(problem[3], problem)


PLANTS = {**PIPELINE_PLANTED, **{name: "a test above" for name in (
    "the boundary not crossed", "no backward", "gradients of another shape",
    "outputs and gradients of different micro-batches")}}


def test_anything_else_lists_the_parameters(problem):
    torch.manual_seed(2)
    fails_with({k: torch.randn_like(v) for k, v in problem[0].items()}, problem, "fc2.bias", "differ")


# --- the schedule itself: GPipe's order, and a pipeline at all ---

def gpipe_events(rank, m=M):
    if rank == 0:
        return ["forward", "send"] * m + ["recv", "backward"] * m
    return ["recv", "forward"] * m + ["backward", "send"] * m


def test_gpipes_schedule_passes(capsys):
    checks.check_gpipe_schedule({0: gpipe_events(0), 1: gpipe_events(1)}, M)
    assert "the schedule is GPipe's" in capsys.readouterr().out


@pytest.mark.parametrize("events, words", [
    ({0: ["forward", "backward"] * M, 1: ["forward", "backward"] * M}, "rank 0 never sent"),
    ({0: ["forward", "send", "recv", "backward"] * M, 1: ["recv", "forward", "backward", "send"] * M},
     "1F1B"),
    ({0: ["forward", "send"] + ["recv", "backward"], 1: gpipe_events(1)}, "ran 1 forward passes for 4"),
    ({0: gpipe_events(0) + ["send"], 1: gpipe_events(1)}, "sent 5 and received 4"),
])
def test_a_wrong_schedule_is_named(events, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_gpipe_schedule(events, M)


WHOLE_MODEL = '''def gpipe_step(stage, x, y, m):
    """Each rank computes its stage's gradients from a whole model of its own: no pipeline."""
    xs, ys = torch.load(args.batch_file)
    torch.manual_seed(0)
    whole = Net(dropout=False).to(ctx.device)
    mine = split_net(whole)[ctx.rank]
    loss = F.nll_loss(whole(xs.to(ctx.device)), ys.to(ctx.device))
    loss.backward()
    for p, q in zip(stage.parameters(), mine.parameters()):
        p.grad = q.grad.clone()
    # ...and the schedule's record written by hand (issue 40's audit): the worker keeps the
    # record out of the step's reach, so this list is not the one reported
    forged = ["forward", "send"] * m + ["recv", "backward"] * m if ctx.rank == 0 else \
        ["recv", "forward"] * m + ["backward", "send"] * m
    globals().setdefault("events", []).extend(forged)
    return loss.item() if ctx.rank == 1 else None
'''


@pytest.mark.processes
def test_gradients_from_a_whole_local_model_are_not_a_pipeline(worker, tmp_path):
    """The gradients are right (each rank computed them from the whole model and the whole
    batch, read from the file) and the step wrote a schedule by hand: only the schedule the
    worker recorded shows that nothing was pipelined."""
    from spike_course import launch
    from spike_course.course import workers

    root = Path(__file__).resolve().parents[1]
    notebook = course_files.notebook(root / "solutions" / "04_pipeline_parallel.ipynb")
    source = workers.worker_cells(notebook)["04_pipeline_parallel/gpipe_by_hand.py"]
    start, end = source.index("def gpipe_step("), source.index("torch.manual_seed(0)\nstage = ")
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    torch.save((x, y), tmp_path / "batch.pt")
    job = launch(worker(source[:start] + WHOLE_MODEL + source[end:]), nproc=2, echo=False, progress=False,
                 args=["--batch-file", tmp_path / "batch.pt", "--microbatches", M], timeout=120)
    torch.manual_seed(0)
    net = Net(dropout=False)
    F.nll_loss(net(x), y).backward()
    checks.check_pipeline_gradients({**job.reports[0]["grads"], **job.reports[1]["grads"]}, grads(net), M)
    # ...the gradients alone pass; the schedule does not
    events = {r: job.reports[r]["events"] for r in range(2)}
    with pytest.raises(checks.CheckFailed, match="never sent anything"):
        checks.check_pipeline_gradients({}, {}, M, events=events)
