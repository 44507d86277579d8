"""Chapter 13's check passes on the solution and names each mistake planted in a copy of it.

The solution's answer is plan_job, the code between its solution markers; each test replaces
one piece of that code, runs it and asserts the check's message. The check lays each plan
out on the fake process group in this process (the meta device: nothing is allocated), so
no rank is started.
"""

from pathlib import Path

import pytest

from spike_course import costmodel
from spike_course.course import conventions
from spike_course.checks import CheckFailed, check_job_plan, ch13_sizing as sizing
from named import mistake_of, names
from planting import answer_function

import course_files

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = course_files.notebook(ROOT / "solutions" / "13_sizing_a_job.ipynb")
SOLUTION = next(cell.source for cell in NOTEBOOK.cells
                if cell.cell_type == "code" and conventions.has_solution(cell))
ANSWER = SOLUTION.split("\n\n\nplan = ")[0]  # the function alone, not the cell's call of it


def planted(old="", new=""):
    return answer_function(ANSWER, "plan_job", old, new, {"costmodel": costmodel})  # the notebook's imports


def test_solution_passes(capsys):
    check_job_plan(planted())
    assert "check passed" in capsys.readouterr().out


MISTAKES = {
    # the named mistakes
    "optimizer bytes forgotten": ("states = 16 * params / gpus", "states = 8 * params / gpus",
                                  "optimizer's bytes are forgotten"),
    "activations of the global batch": ("activation_bytes(micro_batch, seq", "activation_bytes(micro_batch * dp, seq",
                                        "counted for the global batch"),
    "tensor parallel across nodes": ("(1, 2, 4, 8) if t <= per_node", "(16,) if t <= gpus",
                                     "tensor parallel across nodes"),
    "misses the deadline": ("if hours > deadline_hours:", "if hours > 2 * deadline_hours:",
                            "misses the deadline"),
    "does not fit": ("if states + acts <= budget:", "if states <= budget:", "does not fit"),
    "mesh does not multiply to the GPU count": ("dp = gpus // tp", "dp = gpus", "does not multiply"),
    # more of them
    "a node to spare": ("if hours > deadline_hours:", "if hours > deadline_hours / 2:",
                        "would also meet the"),
    "peak instead of MFU": ("step = 6 * params * micro_batch * seq * dp / (gpus * rate)",
                            "step = 6 * params * micro_batch * seq * dp / (gpus * cluster['peak'])",
                            "peak is used as their speed"),
    "one micro-batch per step": ("micro_batch * seq * dp / (gpus", "micro_batch * seq / (gpus",
                                 "one micro-batch per step"),
    "states not divided by tp": ("states = 16 * params / gpus", "states = 16 * params / dp",
                                 "not divided by tp"),
    "activations not divided by tp": ('"activation_bytes": acts,', '"activation_bytes": acts * tp,',
                                      "not divided by tp"),
    "tp straddles nodes": ("(1, 2, 4, 8) if t <= per_node", "(1, 3) if t <= per_node",
                           "straddle two nodes"),
    # the rest of the check's tables: wrong figures reported for a right plan, or plans past the cluster
    "only the parameters counted": ('"states_bytes": states,', '"states_bytes": states / 4,', "only the parameters"),
    "gradients forgotten": ('"states_bytes": states,', '"states_bytes": states * 3 / 4,', "gradients are forgotten"),
    "states not divided by dp": ('"states_bytes": states,', '"states_bytes": states * dp,', "not divided by dp"),
    # told apart from the global batch's where tp > 1 (with tp = 1 the two are the same figure)
    "activations of every GPU": ('"activation_bytes": acts,', '"activation_bytes": acts if tp == 1 else costmodel.'
                                 'activation_bytes(micro_batch * gpus, seq, dim, hidden, layers, heads, vocab, "bf16")'
                                 ' / tp,', "every GPU's micro-batch"),
    "activations in fp32": ('"bf16") / tp', '"fp32") / tp', "counted in fp32"),
    "work not shared": ("/ (gpus * rate)\n                    return", "/ rate\n                    return",
                        "not shared among the GPUs"),
    "tp's GPUs not sharing the work": ("/ (gpus * rate)\n                    return",
                                       "/ (dp * rate)\n                    return", "tensor parallel's GPUs"),
    "more GPUs than the cluster lends": ("    for gpus in counts:",
                                         '    for gpus in [g + cluster["max_gpus"] for g in counts if g >= per_node]:',
                                         "lends at most 256 GPUs"),
    "not whole nodes": ("list(range(per_node, cluster", "list(range(per_node + 4, cluster", "not whole nodes"),
}


CHECK_MODULE, PLANTS = sizing, MISTAKES  # tests/named.py


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named(name):
    old, new, message = MISTAKES[name]
    with names(mistake_of(name), says=message):
        check_job_plan(planted(old, new))


def test_the_blank_is_named():
    def plan_job(shape, seq, tokens, deadline_hours, cluster):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_job_plan(plan_job)


def test_a_plan_for_the_exercise_alone_fails():
    # the solution's answer for the exercise's model, returned whatever the job: right for
    # the first case, wrong for the check's own
    answer = planted()((40, 5120, 13824, 40, 32000, 4096), 4096, 260e9, 168,
                       {"gpus_per_node": 8, "gpu_memory": 180e9, "usable": 0.9,
                        "peak": costmodel.B200_BF16_FLOPS, "mfu": 0.40, "max_gpus": 256})

    def plan_job(shape, seq, tokens, deadline_hours, cluster):
        return dict(answer)

    with pytest.raises(CheckFailed, match="a 1B model"):
        check_job_plan(plan_job)


def test_the_course_memory_plan_is_not_an_answer():
    def plan_job(shape, seq, tokens, deadline_hours, cluster):
        return costmodel.memory_plan(shape, seq, 1)

    with pytest.raises(CheckFailed, match="calls memory_plan"):
        check_job_plan(plan_job)
