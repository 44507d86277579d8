"""Exercise check for chapter 16: ZeRO-3 by hand on units of several parameters, prefetching
in both directions.

``check_sharded_blocks`` launches the learner's script under ``zero3_probe.py``, which records
outside the answer's reach every all-gather (issued async or not, in the forward or the
backward, and the bytes all gathered parameters held at that moment), every wait for one,
every module that began its forward on parameters still arriving, a digest of the shards
after each step, and a trace of the last step. The same probe trains the model with FSDP2 in
a launch of its own: the shards must equal FSDP2's bit for bit after every step, and the trace
must show all-gathers running while the rank computed, in the forward and in the backward."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ._common import CheckFailed, Mistake, name_the_first, passed

PROBE = Path(__file__).parents[1] / "lab" / "zero3_probe.py"
WORLD, STEPS, WIDTH, UNITS = 2, 3, 128, 4  # the script's defaults, but for --steps
# A unit's parameters, in bytes: Linear(w, 2w) and Linear(2w, w), weights and biases, float32.
UNIT_BYTES = 4 * (WIDTH * 2 * WIDTH + 2 * WIDTH + 2 * WIDTH * WIDTH + WIDTH)
COMPUTE = ("aten::mm", "aten::addmm", "aten::tanh")  # what a rank computes, in its trace
_REFERENCE = {}  # FSDP2's digests, computed once per kernel


class Run:
    """What the probe recorded on every rank: the gathers of the first step, by phase, the
    largest bytes held in a forward, unwaited uses, digests; and the last step's trace."""

    def __init__(self, log: Path):
        self.events = {r: _lines(log / f"rank{r}.jsonl") for r in range(WORLD)}
        gathers = [e for e in self.events[0] if e["event"] == "gather" and e["step"] == 0]
        self.forward = [e for e in gathers if not e["backward"]]
        self.backward = [e for e in gathers if e["backward"]]
        self.held = max((e["held"] for r in range(WORLD) for e in self.events[r]
                         if e["event"] == "gather" and not e["backward"]), default=0)
        self.unwaited = next((e for r in range(WORLD) for e in self.events[r] if e["event"] == "unwaited"), None)
        self.digests = {r: [e["digest"] for e in self.events[r] if e["event"] == "stepped"] for r in range(WORLD)}
        self.hidden = {"forward": [], "backward": []}
        for r in range(WORLD):
            if (log / f"trace_rank{r}.json").exists():
                for phase, share in _hidden_shares(log / f"trace_rank{r}.json").items():
                    self.hidden[phase].append(share)

    def all_blocking(self, phase) -> bool:
        gathers = getattr(self, phase)
        return bool(gathers) and not any(e["async"] for e in gathers)

    def nothing_hidden(self, phase) -> bool:
        return bool(self.hidden[phase]) and max(self.hidden[phase]) == 0


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _hidden_shares(path) -> dict:
    """The share of the all-gathers' time during which the rank computed, in the forward and in
    the backward (which begins with autograd's first node) of the traced step."""
    from spike_course.lab import traces

    events = traces.load_trace(path)
    backward = min((e["start"] for e in events if e["name"].startswith("autograd::engine::evaluate_function")),
                   default=float("inf"))
    gathers = traces.spans(events, ["gloo:all_gather"])
    compute = traces.spans(events, COMPUTE)
    return {"forward": traces.hidden_share([g for g in gathers if g[0] < backward], compute),
            "backward": traces.hidden_share([g for g in gathers if g[0] >= backward], compute)}


MISTAKES = (
    Mistake("a gather never waited", lambda run: run.unwaited is not None,
            lambda run: f"in step {run.unwaited['step']} a layer began to compute on parameters whose all-gather "
                        f"(number {run.unwaited['n']}, issued with async_op=True) nobody had waited for: it read "
                        "memory that was still arriving. A handle must be waited for before its parameters are "
                        "used (Hint 1, Hint 2)."),
    Mistake("no gather before backward", lambda run: bool(run.forward) and not run.backward,
            lambda run: "the forward all-gathered its units, but no all-gather ran during the backward: a unit's "
                        "backward needs its parameters, freed after its forward (Hint 3)."),
    Mistake("parameters not freed after forward", lambda run: run.held > 2 * UNIT_BYTES,
            lambda run: f"while the forward ran, the gathered parameters held up to {run.held:,} bytes on a rank, "
                        f"{run.held / UNIT_BYTES:.1f} units' worth ({UNIT_BYTES:,} bytes each): the one computing "
                        "and the one arriving are all a rank needs (Hint 1, Hint 2)."),
    Mistake("forward not prefetched", lambda run: run.all_blocking("forward"),
            lambda run: "every all-gather of the forward was blocking: each unit waited for its parameters, and "
                        "nothing computed while they travelled (Hint 2)."),
    Mistake("forward prefetch waited at once", lambda run: run.nothing_hidden("forward"),
            lambda run: "the forward's all-gathers were issued with async_op=True, but in the trace of the last "
                        "step no compute ran while any of them travelled, on any rank: each was waited for "
                        "before anything else ran (Hint 2)."),
    Mistake("backward not prefetched", lambda run: run.all_blocking("backward"),
            lambda run: "every all-gather of the backward was blocking: each unit's backward waited for its "
                        "parameters, and nothing computed while they travelled (Hint 3)."),
    Mistake("backward prefetch waited at once", lambda run: run.nothing_hidden("backward"),
            lambda run: "the backward's all-gathers were issued with async_op=True, but in the trace of the last "
                        "step no compute ran while any of them travelled, on any rank (Hint 3)."),
)


def check_sharded_blocks(script) -> None:
    """Run ``script`` (the exercise's sharded_blocks.py) on two ranks under the probe, and judge
    what its ranks did against FSDP2 trained on the same model and batches."""
    reference = _reference()
    job, run = _launch([Path(script).resolve(), "--steps", STEPS])
    if job.failure is not None and job.failure.blank:
        raise CheckFailed("the exercise is not written yet: a rank stopped at `raise NotImplementedError`. "
                          "Replace that line with your code and run the check again.")
    name_the_first(MISTAKES, run)
    if not job.ok:
        raise CheckFailed(f"rank {job.failure.rank} failed (exit code {job.failure.code}): {job.failure.error}. "
                          "Run the script with spike_course.launch to see its traceback.")
    for step in range(STEPS):
        if any(run.digests[r][step:step + 1] != reference[r][step:step + 1] for r in range(WORLD)):
            raise CheckFailed(f"after step {step} the shards differ from FSDP2's, trained on the same model and "
                              "batches: the parameters a unit computed with were not the ones its shards hold.")
    passed(f"{STEPS} steps equal to FSDP2 bit for bit, at most {run.held:,} bytes of gathered parameters held in "
           f"the forward (two units), all-gathers hidden behind compute: forward "
           f"{max(run.hidden['forward']):.0%}, backward {max(run.hidden['backward']):.0%} (the better rank)")


def _reference() -> dict:
    """FSDP2's digests after each step, per rank (one launch, once per kernel)."""
    if not _REFERENCE:
        job, run = _launch(["--fsdp2", "--steps", STEPS])
        if not job.ok:
            raise RuntimeError(f"the FSDP2 reference failed: {job.failure}")
        _REFERENCE.update(run.digests)
    return _REFERENCE


def _launch(args):
    """A launch of the probe on WORLD ranks: its result and what the probe recorded."""
    import spike_course

    log = Path(tempfile.mkdtemp(prefix="spike_course_zero3_"))
    try:
        job = spike_course.launch(PROBE, nproc=WORLD, check=False, echo=False, progress=False, timeout=120,
                                  args=[log, STEPS, *args])
        return job, Run(log)
    finally:
        shutil.rmtree(log, ignore_errors=True)
