"""checks.check_matmul_reduce_scatter (chapter 16.4): the row-parallel end of a sequence-parallel
block as a ring of running sums, each transfer hidden under a product.

The check launches the answer under a probe on four ranks. The probe runs several scripts one
after the other in one launch, so every planted mistake below shares a single launch (about 10 s
on 2 cores); the solution and the blank go through the check itself, a launch each."""

import pytest

from spike_course.checks import ch16_async_tp
from spike_course.checks import Tampering, check_matmul_reduce_scatter
from spike_course.course import conventions
from named import mistake_of, names
from planting import planted

import course_files

NOTEBOOK = course_files.notebook(course_files.ROOT / "solutions" / "16_what_large_jobs_run_today.ipynb")
WORKER = conventions.written_file(NOTEBOOK, "workers/16_what_large_jobs_run_today/matmul_reduce_scatter.py")

PRODUCT = "        partial = h[block * rows:(block + 1) * rows] @ w  # computed while the last sum travels\n"
WAIT = "        for transfer in in_flight:\n            transfer.wait()\n"
SEND = "        in_flight = [dist.isend(partial, (rank + 1) % world), dist.irecv(arriving, (rank - 1) % world)]\n"
# Two plants wait for a handle again at the next step, as a learner may: the probe answers a
# second wait at once (gloo's would block until a timeout).
# A mistake of the check's table (its name, and what tells the plant apart) -> the changes that
# plant it, and what the message says.
PLANTS = {
    "a collective, not a ring": ([("    rank, world = dist.get_rank(), dist.get_world_size()\n",
                                   "    return plain(h, w)\n")], "ran _reduce_scatter_base_"),
    "inputs changed in place (h)": ([(PRODUCT, PRODUCT + "        h[0, 0] += 1\n")], "changed h or w"),
    "rows of another rank (the blocks one step off)": ([("block = (rank - k - 1) % world",
                                                         "block = (rank - k) % world")], "sum of rank 1's rows"),
    "a partial missing (the rank's own)": ([("            return partial", "            return arriving")],
                                           "without rank 0's partial"),
    "a partial counted twice (the rank's own)": ([("            return partial",
                                                   "            return partial + h[rank * rows:(rank + 1) * rows] @ w")],
                                                 "rank 0's partial product counted twice"),
    "more bytes than a reduce-scatter (every sum sent twice over)": (
        [("        arriving = torch.empty_like(partial)\n", "        arriving = torch.empty(2 * rows, w.shape[1])\n"),
         ("dist.isend(partial,", "dist.isend(torch.cat([partial, partial]),"),
         ("partial += arriving", "partial += arriving[:rows]")], "sent 147,456 bytes"),
    "nothing overlaps (each transfer waited for at once)": ([(SEND, SEND + WAIT)], None),
    "not every transfer hidden (the second product waits)": (
        [(PRODUCT, "        if k == 1:\n" + WAIT.replace("        ", "            ")
          + PRODUCT)], "rank 0 computed 2 of its products"),
}
CHECK_MODULE = ch16_async_tp  # tests/named.py


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory):
    """Every plant's run, from one launch of the probe over all of them."""
    folder = tmp_path_factory.mktemp("plants")
    scripts = []
    for number, name in enumerate(sorted(PLANTS)):
        scripts.append(folder / f"plant{number}.py")
        scripts[-1].write_text(planted(WORKER, *PLANTS[name][0]))
    job, runs = ch16_async_tp.launch_probe(scripts)
    assert job.ok and len(runs) == len(PLANTS), job.failure
    return dict(zip(sorted(PLANTS), runs))


@pytest.mark.processes
def test_the_solution_passes(worker, no_orphans, capsys):
    check_matmul_reduce_scatter(worker(WORKER, "matmul_reduce_scatter.py"))
    assert "every one of the 3 transfers under a product" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_mistake_is_named(name, planted_runs):
    with names(mistake_of(name), says=PLANTS[name][1]):
        ch16_async_tp.judge(planted_runs[name])


@pytest.mark.processes
def test_the_blank_exercise_is_named(worker, no_orphans):
    with names(None, says="not written yet"):
        check_matmul_reduce_scatter(worker(conventions.blank_source(WORKER), "matmul_reduce_scatter.py"))


@pytest.mark.processes
@pytest.mark.parametrize("forgery, replaced", [
    ('sys.modules["__main__"]._judge = lambda *args: {"error": 0.0}', "probe._judge"),
    ("torch.equal = lambda *args: True", "torch.equal"),
])
def test_an_answer_that_replaces_what_the_probe_judges_with_is_named(forgery, replaced, worker, no_orphans):
    """The answer runs in the probe's process: one that rebinds the probe's judgement (then returns
    zeros after empty-handed transfers), or the comparison that sees changed inputs, is named."""
    forged = WORKER.replace("import torch\n", f"import sys\n\nimport torch\n\n{forgery}\n", 1)
    with pytest.raises(Tampering, match=replaced):
        check_matmul_reduce_scatter(worker(forged, "matmul_reduce_scatter.py"))


def test_the_overlap_is_read_from_the_order_of_events():
    """A product counts as hidden when a transfer was issued and nothing was waited for since."""
    ring = {"events": ["product", "send", "recv", "product", "wait", "wait", "send", "recv", "product"]}
    blocking = {"events": ["send", "wait", "recv", "wait", "product", "send", "recv", "wait", "wait", "product"]}
    assert ch16_async_tp.hidden_products(ring) == 2
    assert ch16_async_tp.hidden_products(blocking) == 0
