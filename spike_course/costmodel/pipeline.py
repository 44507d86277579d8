"""Closed-form costs for chapter 04: pipeline parallel (bubble fraction, ideal schedules), and
the simulator that chapter 16 runs any schedule in (a backward split in two, several stages a rank)."""

from __future__ import annotations



PIPELINE_SCHEDULES = ("gpipe", "1f1b")


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of one GPipe or 1F1B step: (p - 1) / (m + p - 1).

    With p equal stages and m micro-batches a step takes m + p - 1 "slots" per rank
    (forward plus backward of one micro-batch on one stage), of which each rank is
    busy for m: filling and draining the pipeline leaves p - 1 slots idle. 1F1B
    reorders the work (and holds fewer activations) but has the same bubble.
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def _pipeline_order(schedule: str, rank: int, stages: int, microbatches: int) -> list:
    """The (phase, microbatch) actions one rank runs, in order."""
    m = microbatches
    if schedule == "gpipe":  # all forwards, then all backwards
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # 1F1B (PyTorch's Schedule1F1B): p - rank forwards to fill the pipeline, then
    # alternate one backward and one forward, then drain the remaining backwards.
    warmup = min(m, stages - rank)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append(("B", backward))
        backward += 1
        if forward < m:
            order.append(("F", forward))
            forward += 1
    return order


def pipeline_schedule(schedule: str, stages: int, microbatches: int,
                      t_forward=1.0, t_backward=2.0) -> list[dict]:
    """The ideal timeline of one step: every rank starts each action as soon as its
    inputs exist (free communication).

    ``t_forward``/``t_backward``: the time of one micro-batch's forward/backward on one
    stage, the same for all stages, or a list with one value per stage (rank).

    Returns event records ``{"rank", "stage", "microbatch", "phase" ("F"/"B"), "start",
    "end"}``, the same format a worker measures, so :func:`spike_course.viz.pipeline_gantt`
    draws both (see :func:`simulate_pipeline` for the rules).
    """
    schedule = schedule.lower()
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    pipeline_bubble(stages, microbatches)  # validates the sizes
    orders = {r: [(r, phase, i) for phase, i in _pipeline_order(schedule, r, stages, microbatches)]
              for r in range(stages)}
    return simulate_pipeline(orders, {"F": t_forward, "B": t_backward})


class PipelineDeadlock(RuntimeError):
    """No rank can start its next action: each waits for one that another rank runs later.
    ``waiting`` maps each unfinished rank to (its next action, the action it waits for)."""

    def __init__(self, waiting: dict):
        self.waiting = waiting
        super().__init__("the pipeline deadlocks: " + "; ".join(
            f"rank {r} waits to run {_label(a)} for {_label(needs)}" for r, (a, needs) in sorted(waiting.items())))


def _label(action) -> str:
    stage, phase, i = action
    return f"the input gradient {i} of stage {stage}" if phase == "G" else f"{phase}{i} of stage {stage}"


def _needs(action, last_stage: int):
    """The action whose result ``action`` (stage, phase, micro-batch) waits for, or None.

    F waits for the previous stage's F; a backward (B, or I, its input-gradient half) for the
    next stage's input gradient (the last stage: its own F); W, the weight-gradient half, for
    the input gradient of its own stage, which it reuses ("G" marks either kind of backward)."""
    stage, phase, i = action
    if phase == "F":
        return (stage - 1, "F", i) if stage > 0 else None
    if phase in ("B", "I"):
        return (stage + 1, "G", i) if stage < last_stage else (stage, "F", i)
    if phase == "W":
        return (stage, "G", i)
    raise ValueError(f"unknown phase {phase!r} in {action!r}: a pipeline runs F, B, I and W")


def _phase_times(times: dict, n_stages: int) -> dict:
    """phase -> one time per stage (a number is every stage's). I and W default to half of B."""
    times = dict(times)
    if "B" in times:
        half = [t / 2 for t in times["B"]] if isinstance(times["B"], (list, tuple)) else times["B"] / 2
        times.setdefault("I", half)
        times.setdefault("W", half)
    per_stage = {}
    for phase, t in times.items():
        t = list(t) if isinstance(t, (list, tuple)) else [t] * n_stages
        if len(t) != n_stages:
            raise ValueError(f"need one {phase} time per stage ({n_stages}), got {len(t)}")
        per_stage[phase] = t
    return per_stage


def simulate_pipeline(orders: dict, times: dict) -> list[dict]:
    """The ideal timeline of one step for any schedule: ``orders`` maps each rank to the
    actions it runs, in order, each ``(stage, phase, microbatch)``; ``times`` maps a phase to
    the time of one micro-batch on one stage (a number, or a list with one per stage).

    Phases: F forward; B the whole backward; I and W its two halves, the input gradient
    (what the previous stage waits for) and the weight gradient (what nobody waits for).
    Each rank runs one action at a time, as soon as the one it needs (see ``_needs``) has
    ended, on whichever rank that ran; communication is free. A rank may run several stages.
    Returns the event records; raises :class:`PipelineDeadlock` where no rank can go on.
    """
    last_stage = max((a[0] for actions in orders.values() for a in actions), default=0)
    times = _phase_times(times, last_stage + 1)
    done: dict = {}  # (stage, phase, microbatch) -> end time; (stage, "G", i) for any backward
    clock = {r: 0.0 for r in orders}
    position = {r: 0 for r in orders}
    events = []
    while any(position[r] < len(orders[r]) for r in orders):
        waiting, progressed = {}, False
        for r, actions in orders.items():
            if position[r] == len(actions):
                continue
            stage, phase, i = action = tuple(actions[position[r]])
            needs = _needs(action, last_stage)
            if needs is not None and needs not in done:
                waiting[r] = (action, needs)
                continue  # its input is not ready: another rank has to move first
            start = max(clock[r], done[needs] if needs else 0.0)
            end = start + times[phase][stage]
            done[action] = clock[r] = end
            if phase in ("B", "I"):
                done[(stage, "G", i)] = end
            events.append({"rank": r, "stage": stage, "microbatch": i, "phase": phase, "start": start, "end": end})
            position[r] += 1
            progressed = True
        if not progressed:
            raise PipelineDeadlock(waiting)
    return sorted(events, key=lambda e: (e["rank"], e["start"]))


def as_event(event) -> dict:
    """One pipeline event as a dict: dicts pass through, tuples are read in the order
    (rank, microbatch, phase, start, end), the order workers print them in."""
    if isinstance(event, dict):
        return event
    rank, microbatch, phase, start, end = event[:5]
    return {"rank": rank, "microbatch": microbatch, "phase": phase, "start": start, "end": end}


def pipeline_idle_fraction(events, per_rank: bool = False):
    """Share of the step the ranks spent waiting, from event records (measured or ideal).

    The step runs from the first start to the last end over all ranks; each rank's idle
    time is that span minus its busy time. Returns the fraction over all ranks, or a
    dict rank -> fraction with ``per_rank=True``. Comparable with :func:`pipeline_bubble`.
    """
    events = [as_event(e) for e in events]
    if not events:
        raise ValueError("no events")
    begin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - begin
    busy: dict = {}
    for e in events:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + (e["end"] - e["start"])
    idle = {r: 1.0 - b / span for r, b in sorted(busy.items())}
    return idle if per_rank else sum(idle.values()) / len(idle)


def pipeline_peak_activations(events) -> dict:
    """Per rank, the most micro-batches whose forward has run but whose backward has not:
    the activations that rank holds at its worst moment (GPipe: m; 1F1B: at most p - rank).
    A backward split in two frees them with its W, which reads them again (a rank that runs
    several stages counts a micro-batch once per stage)."""
    peaks: dict = {}
    by_rank: dict = {}
    for e in map(as_event, events):
        by_rank.setdefault(e["rank"], []).append(e)
    for r, evs in sorted(by_rank.items()):
        held = peak = 0
        for e in sorted(evs, key=lambda e: e["start"]):
            held += 1 if e["phase"] == "F" else -1 if e["phase"] in ("B", "W") else 0
            peak = max(peak, held)
        peaks[r] = peak
    return peaks
