"""checks.check_fedavg (chapter 09): FedAvg over the sites that took part in a round, with one
collective. The check passes the right aggregate and names each classic mistake.

Reports built by hand test the messages; then every mistake a learner is likely to make is
planted in a copy of the solution's worker and run on 3 ranks (one launch per mistake, 2-4
seconds each): the lecture's fedavg_ as it is, the absent site's NaN multiplied by a zero
weight, the weights not renormalised over the sites present, the absent sites left with their
old parameters, the samples in a second message, and the blank exercise."""

import math
import re
from pathlib import Path

import pytest
import torch

import spike_course
from spike_course.course import conventions
from spike_course.checks import CheckFailed, check_fedavg, ch09_federated as federated
from named import names
from spike_course.checks.ch09_federated import U32, _combine
from spike_course.course.conventions import written_file
from planting import planted

import course_files

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = course_files.notebook(ROOT / "solutions" / "09_federated_learning.ipynb")
WORKER = written_file(NOTEBOOK, "workers/09_federated_learning/fedavg_exercise.py")

# --- reports built by hand: three sites, one round in which site 1 sat out ---

SAMPLES = [300, 100, 200]
PRESENT = [True, False, True]
BEFORE = [{"w": torch.tensor([1.0, 2.0, -3.0]), "b": torch.tensor([0.5])},
          {"w": torch.tensor([5.0, -2.0, 1.0]), "b": torch.tensor([-1.5])},
          {"w": torch.tensor([-1.0, 4.0, 2.0]), "b": torch.tensor([2.5])}]


def combine(weights):
    """The sites' parameters combined with these weights, as float32 rounds the exact value."""
    return {k: sum(w * s[k].double() for w, s in zip(weights, BEFORE) if w).float() for k in BEFORE[0]}


RIGHT = combine([0.6, 0, 0.4])  # 300 / 500 and 200 / 500


def reports(after, before=BEFORE, present=PRESENT, collectives=(1, 1, 1)):
    return {k: {"rounds": [{"before": before[k], "after": after[k], "samples": SAMPLES[k],
                            "took_part": present[k], "collectives": collectives[k]}]} for k in range(3)}


def test_the_right_aggregate_passes(capsys):
    check_fedavg(reports([RIGHT] * 3))
    assert "check passed" in capsys.readouterr().out


def test_the_tolerance_is_the_float32_bound():
    """One unit in the last place of float32 on a sum of three terms passes; a change well beyond
    gamma_5 (5 roundings for 3 ranks) of the terms' magnitude fails."""
    value, bound = _combine(BEFORE, [0.6, 0, 0.4])
    assert bound["w"][0].item() == pytest.approx(5 * U32 / (1 - 5 * U32) * (0.6 * 1 + 0.4 * 1))
    nudged = {k: torch.nextafter(v.float(), torch.tensor(math.inf)) for k, v in RIGHT.items()}
    check_fedavg(reports([nudged] * 3))
    off = {k: v * (1 + 1e-5) for k, v in RIGHT.items()}
    with pytest.raises(CheckFailed, match="neither the mean"):
        check_fedavg(reports([off] * 3))


NAN = {k: torch.full_like(v, math.nan) for k, v in BEFORE[1].items()}


POISONED = [{k: v * math.nan for k, v in RIGHT.items()}] * 3
# A mistake of the check's tables -> what the ranks report of one round (after, and the other
# readings changed), and what its message says.
AGGREGATES = {
    "absent sites averaged in": (dict(after=[combine([0.5, 1 / 6, 1 / 3])] * 3), r"averaged in all the same"),
    "weights not renormalised": (dict(after=[combine([0.5, 0, 1 / 3])] * 3),
                                 r"share of ALL sites' samples.*add up to 0\.83"),
    "unweighted mean": (dict(after=[combine([0.5, 0, 0.5])] * 3), r"unweighted mean"),
    "not divided by the samples": (dict(after=[combine([300, 0, 200])] * 3), r"not divided"),
    "never added up": (dict(after=[combine([0.6, 0, 0]), BEFORE[1], combine([0, 0, 0.4])]), r"never added up"),
    "absent sites keep their own": (dict(after=[RIGHT, BEFORE[1], RIGHT]),
                                    r"site\(s\) \[1\], which sat out, still hold their own"),
    "result never reached the parameters": (dict(after=BEFORE), r"no rank's parameters changed"),
    "only some ranks hold it": (dict(after=[RIGHT, RIGHT, BEFORE[2]]), r"rank\(s\) \[2\] do not"),
    "a parameter left out": (dict(after=[{"w": RIGHT["w"]}] * 3), r"\['b'\] are missing"),
    "absent site times zero": (dict(after=POISONED, before=[BEFORE[0], NAN, BEFORE[2]]),
                               r"Site\(s\) \[1\] sat out with non-finite.*0 \* NaN is NaN"),
    "division by zero": (dict(after=POISONED), r"although no site's parameters did"),
    "samples in a second message": (dict(after=[RIGHT] * 3, collectives=(2, 2, 2)),
                                    r"a call made 2 collectives, the samples present and the parameters"),
    "one collective per tensor": (dict(after=[RIGHT] * 3, collectives=(3, 3, 3)),
                                  r"a call made 3 collectives: one per parameter tensor \(2\)"),
}
CHECK_MODULE, PLANTS = federated, AGGREGATES  # tests/named.py


@pytest.mark.parametrize("name", AGGREGATES)
def test_a_wrong_aggregate_is_named(name):
    readings, message = AGGREGATES[name]
    with names(name, says=re.compile(message, re.S)):
        check_fedavg(reports(**readings))


def test_a_nan_of_an_absent_site_left_out_passes():
    check_fedavg(reports([RIGHT] * 3, before=[BEFORE[0], NAN, BEFORE[2]]))


# --- mistakes planted in a copy of the solution's worker, run on 3 ranks ---

LECTURE = """\
    device = next(model.parameters()).device
    total = torch.tensor([float(num_samples)], device=device)
    dist.all_reduce(total)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(num_samples / total.item())
            dist.all_reduce(p)
    return
"""
MISTAKES = {
    "blank": (None, r"fedavg_ is not written yet"),
    "the_lecture_s_fedavg": ([("    from torch.nn.utils", LECTURE + "    from torch.nn.utils")],
                             r"after round 2 .*averaged in all the same"),
    "absent_site_times_zero": ([("        message = flat.new_zeros(len(flat) + 1)",
                                 "        message = torch.cat([flat * 0, flat.new_tensor([0])])")],
                               r"after round 3 .*0 \* NaN is NaN"),
    "weights_not_renormalised": ([("        message = flat.new_zeros(len(flat) + 1)",
                                   "        message = torch.cat([flat.new_zeros(len(flat)), "
                                   "flat.new_tensor([num_samples])])")],
                                 r"after round 2 .*share of ALL sites' samples"),
    "absent_sites_keep_their_own": ([("    vector_to_parameters(", "    if took_part:\n"
                                                                   "        vector_to_parameters(")],
                                    r"after round 2 .*which sat out, still hold their own"),
    "samples_in_a_second_message": ([("    dist.all_reduce(message)",
                                      "    total = message[-1:].clone()\n"
                                      "    dist.all_reduce(total)  # the samples present, on their own\n"
                                      "    dist.all_reduce(message)")],
                                    r"a call made 2 collectives, the samples present and the parameters in separate"),
}


PLANTED_MISTAKE = {"the_lecture_s_fedavg": "absent sites averaged in",
                   "absent_site_times_zero": "absent site times zero", "weights_not_renormalised": "weights not renormalised",
                   "absent_sites_keep_their_own": "absent sites keep their own",
                   "samples_in_a_second_message": "samples in a second message"}


def run(worker, source):
    return spike_course.launch(worker(source, "fedavg_exercise.py"), nproc=3, echo=False, progress=False,
                               timeout=120, check=False)


@pytest.mark.processes
def test_the_solution_passes(worker, no_orphans, capsys):
    job = run(worker, WORKER)
    assert job.ok
    assert [site["collectives"] for site in job.reports[0]["rounds"]] == [1, 1, 1]
    check_fedavg(job)
    assert "after each of 3 rounds all 3 sites hold the mean over the sites present" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_planted_mistake_is_named(mistake, worker, no_orphans):
    changes, message = MISTAKES[mistake]
    source = conventions.blank_source(WORKER) if changes is None else planted(WORKER, *changes)
    job = run(worker, source)
    if mistake == "the_lecture_s_fedavg":  # 1 + one all-reduce per tensor of the transformer
        assert [site["collectives"] for site in job.reports[0]["rounds"]] == [23, 23, 23]
    with names(PLANTED_MISTAKE.get(mistake), says=re.compile(message, re.S)):
        check_fedavg(job)
