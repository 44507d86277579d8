"""Chapter 12, exercise 1: check_ring_attention passes the solution's merge_block on 2 and 4
ranks and names each classic mistake.

Every mistake is planted in a copy of the solution's ring_merge.py (a line of its solution
region changed), written next to the exercise's own ring_check.py and run on 2 ranks: one
launch per mistake, 2-4 seconds each."""

import re
from pathlib import Path

import pytest

import spike_course
from spike_course.course import conventions, workers
from spike_course.checks import CheckFailed, check_ring_attention, ch12_context_parallel as context_parallel
from named import mistake_of, names
from spike_course.course.conventions import written_file
from planting import planted

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "12_context_and_expert_parallel"
NOTEBOOK = course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb")
HARNESS = workers.worker_cells(NOTEBOOK)[f"{STEM}/ring_check.py"]
MERGE = written_file(NOTEBOOK, f"workers/{STEM}/ring_merge.py")


MAXIMUM = "torch.maximum(m, scores.amax(dim=-1))"
MASK = "k_pos[None, :] > q_pos[:, None]"
# The lecture's merge of finished blocks, with m holding the log-sum-exp, l = 1 and acc the
# normalised result: the ring's rows come out right, but the state is not the streaming one.
LECTURE_FORM = """lse_b = torch.logsumexp(scores, dim=-1)
    out_b = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0) @ v
    new = torch.logaddexp(m, lse_b)
    out = acc / l.clamp(min=1).unsqueeze(-1)
    out = out * torch.exp(m - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
    return new, torch.ones_like(new), out
    return m_new,"""
MISTAKES = {  # a mistake of the check's table (or None: the blank) -> the change, what its message says
    "blank": (None, r"merge_block is not written yet"),
    "scores not scaled": (("/ math.sqrt(q.shape[-1])", ""), r"the scores are not scaled"),
    "maximum not carried": ((MAXIMUM, "scores.amax(dim=-1)"), r"the maximum is not carried"),
    "m not the largest score (never updated)": ((MAXIMUM, "torch.maximum(m, m)"),
                                                r"m is -inf: it must be the largest score seen so far"),
    "maximum not updated": ((MAXIMUM, "torch.where(torch.isinf(m), scores.amax(dim=-1), m)"),
                            r"a score of 800 arrives, and the new m is 0"),
    "normaliser not rescaled": (("l * shrink + p.sum(dim=-1)", "l + p.sum(dim=-1)"),
                                r"the normaliser is not rescaled.*the old l plus this block's 1"),
    "accumulator not rescaled": (("acc * shrink.unsqueeze(-1) + p @ v", "acc + p @ v"),
                                 r"the accumulator is not rescaled like l"),
    "causal mask ignored": (("if causal:", "if False:"), r"the causal mask is not applied"),
    "mask on local indices": ((MASK, "torch.ones(len(q_pos), len(k_pos), dtype=torch.bool).triu(1)"),
                              r"compares local indices, not global positions"),
    "mask reversed": ((MASK, "k_pos[None, :] < q_pos[:, None]"), r"the causal mask is reversed"),
    "m not the largest score (the lecture's finished blocks)": (
        ("return m_new,", LECTURE_FORM), r"m is 2.12693: it must be the largest score seen so far \(2\), not a "
                                         r"log-sum-exp"),
    "diagonal masked": ((MASK, "k_pos[None, :] >= q_pos[:, None]"), r"the causal mask hides the diagonal"),
}
CHECK_MODULE, PLANTS = context_parallel, {key: value for key, value in MISTAKES.items() if key != "blank"}


def run(worker, merge_source, worlds=(2,)):
    """Launch the exercise's harness on each world size next to ``merge_source``."""
    merge = worker(merge_source, "ring_merge.py")
    harness = worker(HARNESS, "ring_check.py")
    return {world: spike_course.launch(harness, nproc=world, echo=False, progress=False, timeout=120,
                                       check=False) for world in worlds}, merge


@pytest.mark.processes
def test_the_solution_passes_on_2_and_4_ranks(worker, no_orphans, capsys):
    jobs, merge = run(worker, MERGE, worlds=(2, 4))
    assert all(job.ok for job in jobs.values())
    check_ring_attention(jobs, merge)
    assert "matches one process on 2, 4 ranks, without and with a causal mask" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_planted_mistake_is_named(mistake, worker, no_orphans):
    change, message = MISTAKES[mistake]
    source = conventions.blank_source(MERGE) if change is None else planted(MERGE, change)
    jobs, merge = run(worker, source)
    with names(None if mistake == "blank" else mistake_of(mistake), says=re.compile(message, re.S)):
        check_ring_attention(jobs, merge)


@pytest.mark.processes
def test_a_wrong_ring_is_failed_even_when_no_probe_names_it(worker, no_orphans):
    """A merge that is right on the probes' tiny blocks (one head, d = 4) but wrong on the
    ring's: the comparison with one process still fails it."""
    flipped = ("if q.shape[0] > 1:  # the probes use one head\n"
               "        p = p.flip(-1)  # each weight with another key's value\n"
               "    return m_new,")
    source = planted(MERGE, ("return m_new,", flipped))
    jobs, merge = run(worker, source)
    with pytest.raises(CheckFailed, match=r"the ring's rows differ from one process's attention by up to"):
        check_ring_attention(jobs, merge)
