"""Exercise check for chapter 16.4: the row-parallel end of a sequence-parallel block as a ring,
each transfer hidden under a product.

``check_matmul_reduce_scatter`` launches ``ring_probe.py`` on four ranks. The probe loads the
learner's script as a module, calls its ``matmul_reduce_scatter`` on inputs of its own drawing,
and records outside the answer's reach every transfer issued, every handle waited for, every
matrix product and every other collective, in order; the bytes sent; whether the inputs changed;
and how far each rank's result is from the exact sum of its rows, within the bound float32
allows (or which wrong sum it is). The answer runs in the probe's process, so the probe notes
anything of its own, or of the torch functions it judges with, that the answer replaced, and the
check names that as tampering. The check judges what the four ranks recorded.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ._common import CheckFailed, Mistake, name_a_stopped_launch, name_the_first, passed
from ._guard import Tampering

PROBE = Path(__file__).parents[1] / "lab" / "ring_probe.py"
WORLD = 4
ROWS, OUTPUTS = 64, 96  # the probe's: rows a rank owns, and the outputs
RING_BYTES = (WORLD - 1) * ROWS * OUTPUTS * 4  # a reduce-scatter's: world - 1 blocks of float32 sums


class Run:
    """What the probe recorded on each rank, for one answer."""

    def __init__(self, records: dict):
        self.ranks = records

    def first(self, seen):
        """The first rank whose record shows something, and the record, or (None, None)."""
        return next(((r, record) for r, record in self.ranks.items() if seen(record)), (None, None))

    def any(self, seen) -> bool:
        return self.first(seen)[0] is not None


def hidden_products(record) -> int:
    """The products that ran while a transfer was in flight: issued, and no wait since."""
    hidden, last = 0, None
    for event in record["events"]:
        if event == "product":
            hidden += last in ("send", "recv")
        else:
            last = event
    return hidden


def _wrong(record, key) -> bool:
    return record.get(key) is not None


def _too_many_bytes(record) -> bool:
    return record["sent_bytes"] > RING_BYTES


def _few_hidden(record) -> bool:
    return hidden_products(record) < WORLD - 1


def _collective_message(run) -> str:
    rank, record = run.first(lambda rec: rec["collectives"])
    return (f"rank {rank} ran {', '.join(sorted(set(record['collectives'])))}: the exercise replaces the "
            "reduce-scatter by sends and receives that overlap the products; a collective waits for the whole "
            "product first. (Hint 1)")


def _sum_message(key, says):
    def message(run):
        rank, record = run.first(lambda rec: _wrong(rec, key))
        hint = ("Which block does each step of the ring compute on each rank, and where does each running sum "
                "end? (Hint 1)" if key == "rows_of" else
                "Count the partial products that reach each sum: one from every rank. (Hint 2)")
        return f"rank {rank}'s result is {says.format(q=record[key])}. {hint}"
    return message


def _bytes_message(run) -> str:
    rank, record = run.first(_too_many_bytes)
    return (f"rank {rank} sent {record['sent_bytes']:,} bytes; a reduce-scatter sends {RING_BYTES:,}: "
            f"{WORLD - 1} blocks of {ROWS} rows' sums. Send running sums of one block, not the activations. "
            "(Hint 1)")


def _hidden_message(run) -> str:
    rank, record = run.first(_few_hidden)
    return (f"rank {rank} computed {hidden_products(record)} of its products while a transfer was in flight; "
            f"the ring has {WORLD - 1} transfers, each of which a product can hide. (Hint 2)")


# What the four ranks recorded, judged in this order: a collective in place of the ring, inputs
# changed, the sums (another rank's rows, a partial missing or twice), the bytes, the overlap.
MISTAKES = (
    Mistake("a collective, not a ring", lambda run: run.any(lambda rec: rec["collectives"]), _collective_message),
    Mistake("inputs changed in place", lambda run: run.any(lambda rec: rec["changed"]),
            "your function changed h or w in place: the block's backward reads them again. (Hint 3)"),
    Mistake("rows of another rank", lambda run: run.any(lambda rec: _wrong(rec, "rows_of")),
            _sum_message("rows_of", "the sum of rank {q}'s rows")),
    Mistake("a partial missing", lambda run: run.any(lambda rec: _wrong(rec, "missing")),
            _sum_message("missing", "its rows' sum without rank {q}'s partial product")),
    Mistake("a partial counted twice", lambda run: run.any(lambda rec: _wrong(rec, "twice")),
            _sum_message("twice", "its rows' sum with rank {q}'s partial product counted twice")),
    Mistake("more bytes than a reduce-scatter", lambda run: run.any(_too_many_bytes), _bytes_message),
    Mistake("nothing overlaps", lambda run: not run.any(hidden_products),
            "no product ran while a transfer was in flight, on any rank: each transfer was waited for before "
            "the next product began. Issue it, compute, then wait. (Hint 2)"),
    Mistake("not every transfer hidden", lambda run: run.any(_few_hidden), _hidden_message),
)


def judge(run: Run) -> None:
    """Name the first mistake the run shows, or fail on what no mistake explains."""
    rank, record = run.first(lambda rec: rec.get("tampered"))
    if rank is not None:
        raise Tampering(f"on rank {rank} your script replaced what the check's probe records and judges with: "
                        f"{', '.join(record['tampered'])}. Leave them as they are.")
    for rank, record in run.ranks.items():
        if record["shape"] != [ROWS, OUTPUTS]:
            raise CheckFailed(f"rank {rank}'s result is {record['shape']}: return the sums of the rank's own "
                              f"{ROWS} rows, a tensor of shape ({ROWS}, {OUTPUTS}).")
    name_the_first(MISTAKES, run)
    rank, record = run.first(lambda rec: rec["error"] > 1)
    if rank is not None:
        raise CheckFailed(f"rank {rank}'s sums are {record['error']:.3g} times farther from the exact sums of its "
                          "rows than float32's rounding allows.")


def check_matmul_reduce_scatter(script) -> None:
    """Run ``script``'s ``matmul_reduce_scatter`` on four ranks under the probe and judge it."""
    job, runs = launch_probe([Path(script).resolve()])
    name_a_stopped_launch(job, "matmul_reduce_scatter")
    run = runs[0]
    judge(run)
    worst = max(record["error"] for record in run.ranks.values())
    passed(f"on {WORLD} ranks every rank holds its rows' sums (within {worst:.0%} of float32's bound), "
           f"{RING_BYTES:,} bytes sent a rank, and every one of the {WORLD - 1} transfers under a product")


def launch_probe(scripts: list) -> tuple:
    """One launch of the probe on WORLD ranks over ``scripts``, one after the other: the launch's
    result and a Run per script that every rank finished."""
    import spike_course

    log = Path(tempfile.mkdtemp(prefix="spike_course_ring_"))
    try:
        job = spike_course.launch(PROBE, nproc=WORLD, check=False, echo=False, progress=False, timeout=120,
                                  args=[log, *scripts])
        runs = [Run({r: json.loads((log / str(i) / f"rank{r}.json").read_text()) for r in range(WORLD)})
                for i in range(len(scripts)) if all((log / str(i) / f"rank{r}.json").exists() for r in range(WORLD))]
        return job, runs
    finally:
        shutil.rmtree(log, ignore_errors=True)
