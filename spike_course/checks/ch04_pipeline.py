"""Exercise checks for chapter 04: pipeline parallel (GPipe by hand)."""

from __future__ import annotations

from functools import cached_property


from ._common import CheckFailed, Mistake, all_close, close, name_the_first, passed


def _scale_between(actual: dict, expected: dict) -> float:
    """The factor s that best explains actual = s * expected (least squares over all tensors)."""
    import torch

    num = sum(float((torch.as_tensor(actual[k]).double() * torch.as_tensor(expected[k]).double()).sum())
              for k in expected)
    den = sum(float(torch.as_tensor(expected[k]).double().pow(2).sum()) for k in expected)
    return num / den if den else float("nan")


def check_gpipe_schedule(events: dict, microbatches: int) -> None:
    """What each rank did, in order ("forward", "backward" of its stage; "send", "recv", ...),
    is a GPipe step over two stages: every stage runs each of the m micro-batches forward and
    backward, all forwards before the first backward, and the stages exchange activations and
    gradients (m each way)."""
    m = microbatches
    for rank, done in sorted(events.items()):
        sends = sum(e in ("send", "isend") for e in done)
        recvs = sum(e in ("recv", "irecv") for e in done)
        if not sends or not recvs:
            raise CheckFailed(f"rank {rank} {'never sent' if not sends else 'never received'} anything: the "
                              "stages did not exchange activations and gradients, so this is not a pipeline.")
        for kind in ("forward", "backward"):
            if done.count(kind) != m:
                raise CheckFailed(f"rank {rank}'s stage ran {done.count(kind)} {kind} passes for {m} "
                                  f"micro-batches: each micro-batch goes through each stage once each way.")
        if sends != m or recvs != m:
            raise CheckFailed(f"rank {rank} sent {sends} and received {recvs} tensors for {m} micro-batches: "
                              "one activation forward and one gradient back per micro-batch.")
        last_forward = max(i for i, e in enumerate(done) if e == "forward")
        if done.index("backward") < last_forward:
            raise CheckFailed(f"rank {rank} ran a backward before its last forward: that is 1F1B (or one "
                              "micro-batch at a time), not GPipe's all forwards, then all backwards.")
    passed(f"the schedule is GPipe's: on every rank {m} forwards, then {m} backwards, with {m} "
           "activations and gradients exchanged")


class _Gradients:
    """The reported gradients against the reference's (all of them, or one stage's), read the
    ways a known mistake shows in them."""

    def __init__(self, grads: dict, reference: dict, m: int, rtol: float, atol: float,
                 last_microbatch: dict | None = None, where: list | None = None):
        self.grads, self.reference, self.m, self.rtol, self.atol = grads, reference, m, rtol, atol
        self.last_microbatch, self.where = last_microbatch, where

    @cached_property
    def scale(self) -> float:
        """The factor s that best explains grads = s * reference."""
        return _scale_between(self.grads, self.reference)

    def times(self, factor: float, expected: dict | None = None) -> bool:
        """Whether the gradients are ``factor`` x ``expected`` (the reference unless told)."""
        return all_close(self.grads, self.reference if expected is None else expected, factor, self.rtol, self.atol)

    def scaled_by(self, factor: float, near: float) -> bool:
        """Whether (with more than one micro-batch, where m and 1/m differ from 1) the gradients
        are the reference's times one factor, and that factor is within ``near`` of ``factor``."""
        return self.m > 1 and abs(self.scale - factor) < near and self.times(self.scale)


# Mistakes that change the gradients of the whole model, told by how they relate to the
# reference (a factor m or 1/m) or to the last micro-batch's own gradients.
WHOLE_MODEL_MISTAKES = (
    Mistake("only the last micro-batch",
             lambda g: g.last_microbatch is not None
             and any(g.times(factor, g.last_microbatch) for factor in (1.0 / g.m, 1.0)),
             lambda g: "only the last micro-batch's gradient is left: gradients must accumulate over "
                       "all micro-batches. Zero them once per step (before the first forward), never "
                       "inside the micro-batch loop, and let every backward add to .grad."),
    Mistake("losses not scaled by 1/m",
             lambda g: g.scaled_by(g.m, 1e-3 * g.m),
             lambda g: f"the gradients are {g.m} x too large: the micro-batch losses were not scaled by 1/m. "
                       f"Each micro-batch's loss is a mean over its own samples; adding up the gradients of "
                       f"{g.m} such means gives {g.m} times the gradient of the whole batch's mean. Divide each "
                       f"micro-batch loss by m = {g.m} before its backward."),
    Mistake("1/m applied twice",
             lambda g: g.scaled_by(1 / g.m, 1e-3 / g.m),
             lambda g: f"the gradients are {g.m} x too small: the 1/m scaling was applied twice (to the loss "
                       f"and again to the gradients, or on both stages). Divide each micro-batch loss by m "
                       f"once, on the last stage only: the earlier stage receives gradients already scaled."),
)

# Mistakes on the way back between the stages, told by the wrong stages' gradients alone (the
# other stage's are right): a factor 1/m or m on them.
STAGE_MISTAKES = (
    Mistake("1/m applied again on the way back",
             lambda g: g.scaled_by(1 / g.m, 1e-3 / g.m),
             lambda g: f"stage {g.where}'s gradients are {g.m} x too small while the other stage is "
                       "right: the 1/m was applied again on the way back. The gradient a stage receives "
                       "is already scaled (the last stage divided its loss by m): use it as it is."),
    Mistake("this stage's losses not scaled",
             lambda g: g.scaled_by(g.m, 1e-3 * g.m),
             lambda g: f"stage {g.where}'s gradients are {g.m} x too large while the other stage is "
                       "right: the micro-batch losses were not scaled by 1/m where this stage's gradient "
                       "comes from. Divide each micro-batch loss by m before its backward, and send back "
                       "the gradient of that scaled loss."),
)


def _unreached(grads: dict, reference: dict) -> list[str]:
    """The parameters with no gradient, or one of zeros where the reference's is not."""
    import torch

    missing = [k for k in reference if grads.get(k) is None]
    return missing + [k for k in reference if k not in missing and not torch.as_tensor(grads[k]).any()
                      and torch.as_tensor(reference[k]).any()]


def _unreached_stages(grads: dict, reference: dict, stages: dict) -> list[int]:
    return sorted({stages[k] for k in _unreached(grads, reference) if k in stages})


# Every parameter has a gradient that is not all zeros: the backward ran, and crossed the stage
# boundary back to the first stage (readings: the gradients, the reference's, each one's stage).
REACH_MISTAKES = (
    Mistake("the boundary not crossed",
            lambda grads, reference, stages: bool(_unreached_stages(grads, reference, stages))
            and min(_unreached_stages(grads, reference, stages)) < max(stages.values(), default=0),
            lambda grads, reference, stages: f"no gradient reached stage {_unreached_stages(grads, reference, stages)} "
                                             f"(parameters {_unreached(grads, reference)}): the backward pass stops at "
                                             "a stage boundary unless you carry it across (Hint 1)."),
    Mistake("no backward", lambda grads, reference, stages: bool(_unreached(grads, reference)),
            lambda grads, reference, stages: f"no gradient for {_unreached(grads, reference)}: did the stage run "
                                             "backward (loss.backward()) and report its parameters' .grad?"),
)


def _shape(t) -> tuple:
    import torch

    return tuple(torch.as_tensor(t).shape)


WRONG_SHAPES = Mistake(
    "gradients of another shape",
    lambda grads, reference: any(_shape(grads[k]) != _shape(reference[k]) for k in reference),
    lambda grads, reference: f"gradients of {[k for k in reference if _shape(grads[k]) != _shape(reference[k])]} "
                             "have the wrong shape: report param.grad for each parameter")

# What else shows where some stages' gradients are right: a received gradient that met another
# micro-batch's output (readings: the wrong stages' gradients).
MISPAIRED = Mistake(
    "outputs and gradients of different micro-batches", lambda g: True,
    lambda g: f"stage {g.where} has wrong gradients ({sorted(g.reference)}) while the other stage is right: each "
              "received gradient must meet the output of the same micro-batch. Keep the forward outputs in a list "
              "and run backward in the order the gradients are sent.")


def _check_stages(g: _Gradients, stages: dict) -> None:
    """Where some stages' gradients are right and others' wrong, the mistake is in what crossed
    the boundary: a 1/m applied again or not at all (told by the wrong stages' gradients alone),
    else a received gradient that met another micro-batch's output."""
    wrong = [k for k in g.reference if not close(g.grads[k], g.reference[k], g.rtol, g.atol)]
    wrong_stages = sorted({stages[k] for k in wrong if k in stages})
    if not (stages and wrong_stages and len(wrong_stages) < len(set(stages.values()))):
        return
    part = {k: g.reference[k] for k in g.reference if stages.get(k) in wrong_stages}
    name_the_first((*STAGE_MISTAKES, MISPAIRED), _Gradients(g.grads, part, g.m, g.rtol, g.atol, where=wrong_stages))


def check_pipeline_gradients(grads: dict, reference: dict, microbatches: int, stages: dict | None = None,
                             last_microbatch: dict | None = None, rtol: float = 1e-4, atol: float = 1e-6,
                             events: dict | None = None) -> None:
    """Check the gradients of a hand-written GPipe step against the single-process model.

    grads: parameter name -> gradient after the pipelined step (all stages merged).
    reference: name -> gradient of the single-process model's mean loss on the whole batch.
    microbatches: m, the number of micro-batches the batch was cut into.
    stages: name -> stage index, so a message can say which stage went wrong.
    last_microbatch: name -> gradient of the last micro-batch's own mean loss (optional;
        lets the check recognise "only the last micro-batch's gradient survived").
    events: rank -> what the rank did, in order (see :func:`check_gpipe_schedule`), checked
        first: right gradients from a wrong schedule, or from no pipeline at all, do not pass.
    """
    if events is not None:
        check_gpipe_schedule(events, microbatches)
    stages = stages or {}
    name_the_first(REACH_MISTAKES, grads, reference, stages)
    name_the_first((WRONG_SHAPES,), grads, reference)
    g = _Gradients(grads, reference, microbatches, rtol, atol, last_microbatch=last_microbatch)
    if g.times(1.0):
        passed(f"GPipe gradients over {microbatches} micro-batches equal the single-process gradients")
        return
    name_the_first(WHOLE_MODEL_MISTAKES, g)
    _check_stages(g, stages)
    wrong = [k for k in reference if not close(grads[k], reference[k], rtol, atol)]
    raise CheckFailed(
        f"gradients of {wrong} differ from the single-process model's (best scale factor "
        f"{g.scale:.4g}). Check that the micro-batches are the batch cut in order (x.chunk(m)), "
        "that the targets are cut the same way, and that every micro-batch runs forward and backward once.")
