"""Exercise check for chapter 16.3: a pipeline schedule with one stage a rank that fills the
bubble with weight gradients (the zero-bubble paper's ZB-H1).

``check_zero_bubble_order`` asks the answer for every rank's order of actions at several
pipeline sizes and runs the orders in the course's simulator (``costmodel.simulate_pipeline``:
each action as soon as its input exists, F, I and W one time unit each, communication free).
It judges each size: every action once, each W after its I, no rank waiting for ever, no rank
holding more micro-batches' activations than 1F1B's first rank does (``stages``), and a step no
longer than the floor: the last rank cannot start before the first micro-batch's
``stages - 1`` forwards have reached it, and then has ``3 * microbatches`` units of work.
"""

from __future__ import annotations

from typing import NamedTuple

from ._common import CheckFailed, Mistake, name_the_first, passed


class Sizes(NamedTuple):
    """The pipeline sizes the answer is run at, (stages, micro-batches), in a tuple the guard
    (``_guard``) watches: an answer that rebinds it to one easy size is named."""
    cases: tuple = ((4, 8), (3, 7), (4, 4), (2, 5), (6, 9))


SIZES = Sizes()
TIMES = {"F": 1.0, "I": 1.0, "W": 1.0}  # one unit each: the exercise's arithmetic, as the lecture's


class Case:
    """One pipeline size: the answer's orders, and what the simulator made of them."""

    def __init__(self, stages: int, microbatches: int, orders: dict):
        self.stages, self.microbatches, self.orders = stages, microbatches, orders
        self.size = f"with {stages} stages and {microbatches} micro-batches"
        self.floor = 3 * microbatches + stages - 1
        self.events = self.deadlock = None
        self.unsplit = any(phase == "B" for order in orders.values() for phase, _ in order)
        self.wrongs, self.early_weights = self.wrong_actions(), self.weight_first()
        if not (self.unsplit or self.wrongs or self.early_weights):
            self.simulate()

    def simulate(self) -> None:
        from .. import costmodel

        stage_orders = {r: [(r, phase, i) for phase, i in order] for r, order in self.orders.items()}
        try:
            self.events = costmodel.simulate_pipeline(stage_orders, TIMES)
        except costmodel.PipelineDeadlock as deadlock:
            self.deadlock = deadlock

    def wrong_actions(self) -> dict:
        """rank -> (missing, repeated, foreign) actions, for the ranks whose F, I and W are not
        each micro-batch's once (foreign: of a micro-batch this size does not have)."""
        wanted = {(phase, i) for phase in "FIW" for i in range(self.microbatches)}
        wrong = {}
        for r, order in self.orders.items():
            missing = sorted(wanted - set(order), key=_by_microbatch)
            repeated = sorted({a for a in order if a in wanted and order.count(a) > 1}, key=_by_microbatch)
            foreign = sorted({a for a in order if a not in wanted}, key=_by_microbatch)
            if missing or repeated or foreign:
                wrong[r] = (missing, repeated, foreign)
        return wrong

    def weight_first(self) -> dict:
        """rank -> the first micro-batch whose W comes before its I in that rank's order."""
        found = {}
        for r, order in self.orders.items():
            early = [i for phase, i in order if phase == "W" and ("I", i) in order
                     and order.index(("W", i)) < order.index(("I", i))]
            if early:
                found[r] = early[0]
        return found

    def peaks(self) -> dict:
        from .. import costmodel

        return costmodel.pipeline_peak_activations(self.events)

    def over_memory(self) -> dict:
        return {r: peak for r, peak in self.peaks().items() if peak > self.stages}

    @property
    def span(self) -> float:
        return max(e["end"] for e in self.events)

    def weight_right_after_input(self) -> bool:
        """Every W runs straight after its own I, on every rank: the lecture's split."""
        return all(order[k + 1] == ("W", i) for order in self.orders.values()
                   for k, (phase, i) in enumerate(order) if phase == "I")


def _by_microbatch(action):
    return action[1], "FIW".index(action[0]) if action[0] in "FIW" else 3


def _first(cases, seen):
    """The first case (in SIZES' order) that shows a mistake, or None."""
    return next((case for case in cases if seen(case)), None)


def _bubble(case) -> bool:
    return case.span > case.floor


def _wrong_actions_message(cases) -> str:
    case = _first(cases, lambda c: c.wrongs)
    r, (missing, repeated, foreign) = next(iter(case.wrongs.items()))
    said = [f"misses {_actions(missing)}"] if missing else []
    if repeated:
        said.append(f"runs {_actions(repeated)} more than once")
    if foreign:
        said.append(f"runs {_actions(foreign)}, of micro-batches it does not have")
    return (f"{case.size}, rank {r} " + " and ".join(said) + ": every rank runs its stage's F, I and W of "
            "each micro-batch once. Does your order depend on the sizes it is given? (The exercise's statement)")


def _actions(actions) -> str:
    shown = ", ".join(f"{phase}{i}" for phase, i in actions[:6])
    return shown + (f" and {len(actions) - 6} more" if len(actions) > 6 else "")


def _weight_first_message(cases) -> str:
    case = _first(cases, lambda c: c.early_weights)
    r, i = next(iter(case.early_weights.items()))
    return (f"{case.size}, rank {r} runs W{i} before I{i}: the weight gradient needs the gradient of the stage's "
            "output, which arrives from the next stage for I. (Hint 1)")


def _deadlock_message(cases) -> str:
    case = _first(cases, lambda c: c.deadlock is not None)
    return (f"{case.size}, {case.deadlock}: one rank's order asks for a result that the other rank "
            "produces only after it has received something from the first. How many forwards must a rank run "
            "before its first I can arrive? (Hint 1)")


def _memory_message(cases) -> str:
    case = _first(cases, lambda c: c.over_memory())
    ranks = ", ".join(f"rank {r} holds {peak}" for r, peak in case.over_memory().items())
    return (f"{case.size}, {ranks} micro-batches' activations at once (forward run, W not yet): 1F1B's "
            f"first rank holds {case.stages}, and no rank may hold more. Each W held back keeps one micro-batch's "
            "activations. (Hint 2)")


def _split_right_after(case) -> bool:
    return _bubble(case) and case.weight_right_after_input()


def _split_message(cases) -> str:
    case = _first(cases, _split_right_after)
    return (f"{case.size}, every W runs straight after its I, and the step takes {case.span:g} units against "
            f"the floor's {case.floor:g}. Splitting the backward let the stage before have its I sooner; but "
            "where does a rank still wait, and what of its own could it run then? (Hint 1)")


def _bubble_message(cases) -> str:
    case = _first(cases, _bubble)
    # Every rank has the same 3 x micro-batches units of work in the same step, so each idles
    # span - floor units more than the floor allows.
    return (f"{case.size}, the step takes {case.span:g} units, more than the floor of {case.floor:g} "
            f"(3 x {case.microbatches} units of work and the {case.stages - 1} forwards before the last rank can "
            f"start): every rank idles {case.span - case.floor:g} units more than it must. Where in the step do "
            "the ranks wait, and which of their actions could run then? (Hint 2)")


# The answer's orders, judged in this order at every size: the actions (a whole backward, then
# each action once), each W after its I, the order run (a deadlock), the memory it holds, and the
# step's length. The readings are the Cases, one a size.
MISTAKES = (
    Mistake("the backward not split", lambda cases: bool(_first(cases, lambda c: c.unsplit)),
            lambda cases: f"{_first(cases, lambda c: c.unsplit).size}, an order runs a whole backward (B): split it into "
            "its input gradient (I) and its weight gradient (W), as section 16.3 did, so that the W can move."),
    Mistake("an action missing or repeated", lambda cases: bool(_first(cases, lambda c: c.wrongs)),
            _wrong_actions_message),
    Mistake("W before its I", lambda cases: bool(_first(cases, lambda c: c.early_weights)),
            _weight_first_message),
    Mistake("the ranks wait on each other", lambda cases: bool(_first(cases, lambda c: c.deadlock is not None)),
            _deadlock_message),
    Mistake("more activations than 1F1B", lambda cases: bool(_first(cases, lambda c: c.over_memory())),
            _memory_message),
    Mistake("W right after its I", lambda cases: bool(_first(cases, _split_right_after)), _split_message),
    Mistake("a bubble left", lambda cases: bool(_first(cases, _bubble)), _bubble_message),
)


def _order_of(answer, rank: int, stages: int, microbatches: int) -> list:
    """The answer's order for one rank, as a new list of (phase, micro-batch) tuples of plain
    str and int: what the check runs is its own copy."""
    try:
        returned = answer(rank, stages, microbatches)
    except NotImplementedError:
        raise CheckFailed("zero_bubble_order still raises NotImplementedError: write it first.") from None
    if type(returned) is not list:
        raise CheckFailed(f"zero_bubble_order({rank}, {stages}, {microbatches}) returned {returned!r:.120}: return "
                          "a list of (phase, micro-batch) pairs, such as [('F', 0), ('F', 1), ('I', 0), ...]")
    order = []
    for action in returned:
        if (type(action) is not tuple or len(action) != 2 or type(action[0]) is not str
                or action[0] not in ("F", "I", "W", "B") or type(action[1]) is not int):
            raise CheckFailed(f"zero_bubble_order({rank}, {stages}, {microbatches}) holds {action!r:.80}: each "
                              "action is a pair (phase, micro-batch), the phase 'F', 'I' or 'W', the micro-batch "
                              "an int")
        order.append((str(action[0]), int(action[1])))
    return order


def cases_of(answer) -> list:
    """Every size's Case (simulated where its actions are each micro-batch's F, I and W once)."""
    cases = []
    for stages, microbatches in SIZES.cases:
        cases.append(Case(stages, microbatches,
                          {r: _order_of(answer, r, stages, microbatches) for r in range(stages)}))
    return cases


def check_zero_bubble_order(answer) -> None:
    """``answer(rank, stages, microbatches)`` returns that rank's actions in order: pairs
    ``(phase, microbatch)`` with the phase "F", "I" or "W"."""
    cases = cases_of(answer)
    name_the_first(MISTAKES, cases)
    worst = max(max(case.peaks().values()) - case.stages for case in cases)
    passed(f"at {len(cases)} pipeline sizes every rank runs each F, I and W once, no rank holds more "
           f"activations than 1F1B's first (at most {worst:+d} of it), and each step takes the floor, "
           "3 x micro-batches + stages - 1 units: no bubble but the forwards' way to the last rank")
