"""Chapter 05, exercise 2: check_tp_plan passes the solution's plan and names each mistake
planted in a copy of it.

The solution's tp_plan.py and the exercise's check_plan.py come from the solution notebook.
Every planted copy is written next to the check script under its own module name, and ONE
launch runs them all (check_plan.py takes several plan modules): a launch is 6-10 seconds.
"""

from pathlib import Path

import pytest

import spike_course
from spike_course.course import workers
from spike_course.checks import CheckFailed, check_tp_plan, ch05_tensor_parallel as tensor_parallel
from named import names

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "05_tensor_parallel"
SOURCES = workers.worker_cells(course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb"))
PLAN, CHECK_SCRIPT = SOURCES[f"{STEM}/tp_plan.py"], SOURCES[f"{STEM}/check_plan.py"]

MISTAKES = {
    "mlp_both_colwise": ([('"feed_forward.w2": RowwiseParallel()', '"feed_forward.w2": ColwiseParallel()')],
                         "feed_forward.w2 is ColwiseParallel like w1, w3"),
    "attention_both_colwise": ([('"attention.wo": RowwiseParallel()', '"attention.wo": ColwiseParallel()')],
                               "attention.wo is ColwiseParallel like wq, wk, wv"),
    "mlp_row_then_column": ([('"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()',
                              '"feed_forward.w1": RowwiseParallel(), "feed_forward.w3": RowwiseParallel()'),
                             ('"feed_forward.w2": RowwiseParallel()', '"feed_forward.w2": ColwiseParallel()')],
                            "feed_forward: w1, w3 are RowwiseParallel and w2 ColwiseParallel, the wrong way round"),
    "attention_row_then_column": ([('"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel()',
                                    '"attention.wq": RowwiseParallel(), "attention.wk": RowwiseParallel()'),
                                   ('"attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()',
                                    '"attention.wv": RowwiseParallel(), "attention.wo": ColwiseParallel()')],
                                  "wrong way round"),
    "logits_not_replicated": ([('ColwiseParallel(output_layouts=Replicate())', 'ColwiseParallel()')],
                              "only its vocabulary slice"),
    "embedding_left_whole": ([('"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),', '')],
                             "weight is not sharded, e.g. tok_embeddings.weight"),
    "attention_input_not_shared": ([('"attention": one_input(),', '')],
                                   "attention all-reduces 3 input gradients in backward"),
}


# Each plant by the mistake the check's tables name it (tests/named.py).
PLANTED_MISTAKE = {"mlp_both_colwise": "feed_forward both colwise", "attention_both_colwise": "attention both colwise",
                   "mlp_row_then_column": "feed_forward row then column",
                   "attention_row_then_column": "attention row then column",
                   "logits_not_replicated": "logits not replicated", "embedding_left_whole": "a weight left whole",
                   "attention_input_not_shared": "a region's input not shared"}
CHECK_MODULE, PLANTS = tensor_parallel, {name: plant for plant, name in PLANTED_MISTAKE.items()}


def plant(changes):
    source = PLAN
    for old, new in changes:
        assert old in source, f"the solution no longer contains {old!r}: update this test"
        source = source.replace(old, new, 1)
    return source


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_plan")
    (folder / "check_plan.py").write_text(CHECK_SCRIPT)
    (folder / "tp_plan.py").write_text(PLAN)
    for name, (changes, _) in MISTAKES.items():
        (folder / f"{name}.py").write_text(plant(changes))
    return spike_course.launch(folder / "check_plan.py", nproc=2, args=["tp_plan", *MISTAKES],
                               echo=False, progress=False, timeout=240).reports


@pytest.mark.processes
def test_solution_passes(launched, capsys):
    check_tp_plan(launched)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named(launched, name):
    with names(PLANTED_MISTAKE[name], says=MISTAKES[name][1]):
        check_tp_plan(launched, plan=name)
