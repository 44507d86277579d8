"""Chapter 04, exercise 2: check_pipeline_training passes the solution's functions and names each
mistake planted in a copy of them. Every planted copy is a module next to the script, which
runs them all in ONE launch (a launch is 6-10 seconds)."""

import copy
from pathlib import Path

import pytest
import torch

import spike_course
from spike_course.course import workers
from spike_course.checks import CheckFailed, check_pipeline_training, ch04_pipeline_training as pipeline_training
from named import mistake_of, names
from spike_course.data import load_mnist

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "04_pipeline_parallel"
SOURCES = workers.worker_cells(course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb"))
FUNCTIONS, SCRIPT = SOURCES[f"{STEM}/pipeline_functions.py"], SOURCES[f"{STEM}/pipeline_epochs.py"]
TRAIN, TEST = 128, 64


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    digits = load_mnist(limit=TRAIN + TEST)
    images = torch.stack([digits[i][0] for i in range(TRAIN + TEST)])
    labels = torch.tensor([digits[i][1] for i in range(TRAIN + TEST)])
    path = tmp_path_factory.mktemp("digits") / "digits.pt"
    torch.save((images[:TRAIN], labels[:TRAIN], images[TRAIN:], labels[TRAIN:]), path)
    return path


def plant(changes):
    source = FUNCTIONS
    for old, new, count in changes:
        assert source.count(old) == count, f"the solution no longer has {old!r} {count} times: update this test"
        source = source.replace(old, new)
    return source


@pytest.fixture(scope="module")
def launched(tmp_path_factory, data_file):
    """One launch runs the solution's functions and every planted copy, each from fresh weights."""
    folder = tmp_path_factory.mktemp("pipeline_epochs")
    (folder / "pipeline_epochs.py").write_text(SCRIPT)
    (folder / "pipeline_functions.py").write_text(FUNCTIONS)
    for name, (changes, _) in MISTAKES.items():
        (folder / f"{name}.py").write_text(plant(changes))
    return spike_course.launch(folder / "pipeline_epochs.py", nproc=2,
                               args=["--data-file", data_file, "pipeline_functions", *MISTAKES],
                               echo=False, progress=False, timeout=240).reports


@pytest.mark.processes
def test_solution_passes(launched, data_file, capsys):
    check_pipeline_training(launched, data_file)
    assert "check passed" in capsys.readouterr().out


MISTAKES = {
    "seed_per_rank": ([("manual_seed(SEED)", "manual_seed(SEED + torch.distributed.get_rank())", 1)],
                      "different orders"),
    "global_generator": ([("shuffle=shuffle, generator=generator)", "shuffle=shuffle)", 1)],
                         "different orders"),
    "distributed_sampler": ([("shuffle=shuffle, generator=generator)",
                               "sampler=torch.utils.data.DistributedSampler(dataset, shuffle=shuffle))", 1)],
                             "read disjoint training samples"),
    "no_train_mode": ([("    module.train()  #", "    pass  #", 1)], "never switched it back"),
    "no_eval_mode": ([("    module.eval()\n", "", 1)], "in training mode during evaluation"),
    "first_microbatch_loss": ([("sum(loss.item() * size for loss, size in zip(losses, sizes))",
                                       "losses[0].item() * len(labels)", 1)], "first micro-batch's loss"),
    "step_under_no_grad": ([("    module.eval()\n", "    module.eval()\n    torch.set_grad_enabled(False)\n", 1),
                              ("schedule.eval(", "schedule.step(", 3)], "under torch.no_grad"),
    "stub_left": ([("    module.eval()\n", "    raise NotImplementedError\n", 1)], "still raise NotImplementedError"),
    "gradients_never_zeroed": ([("        optimizer.zero_grad()\n", "", 1)],
                               "differs from one process trained on the same batches"),
    "unweighted_loss": ([("sum(loss.item() * size for loss, size in zip(losses, sizes))",
                          "sum(loss.item() for loss in losses)", 1)], "each a MEAN over its own samples"),
    "last_batch_accuracy": ([("correct += ", "correct = ", 1)], r"accuracy .* over all the test set"),
    "nothing_returned": ([("    return (loss_sum / count, correct / count) if stage.is_last else None\n", "", 1)],
                         r"evaluate\(\) returned \[None, None\]"),
}


# Each plant by the mistake of the check's tables it is named as (tests/named.py).
MISTAKE_OF_PLANT = {"stub_left": "stubs left", "step_under_no_grad": "step() under no_grad",
                    "first_microbatch_loss": "first micro-batch only", "unweighted_loss": "unweighted mean",
                    "seed_per_rank": "the stages in different orders (a seed per rank)",
                    "global_generator": "the stages in different orders (the global generator)",
                    "distributed_sampler": "a DistributedSampler between the stages",
                    "no_train_mode": "train mode not restored", "no_eval_mode": "dropout on in evaluation",
                    "gradients_never_zeroed": "another training step",
                    "last_batch_accuracy": "accuracy not over the whole test set",
                    "nothing_returned": "nothing returned"}
CHECK_MODULE = pipeline_training
PLANTS = {mistake: plant for plant, mistake in MISTAKE_OF_PLANT.items()}


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named(launched, data_file, name):
    with names(mistake_of(MISTAKE_OF_PLANT[name]), says=MISTAKES[name][1]):
        check_pipeline_training(launched, data_file, functions=name)


@pytest.mark.processes
@pytest.mark.parametrize("which, message", [(0, "test loss nan"), (1, "accuracy nan")])
def test_a_nan_evaluation_fails(launched, data_file, which, message):
    """NaN compares false with everything: a check written as `error > tolerance` passed it."""
    reports = copy.deepcopy(launched)
    history = reports[1]["runs"]["pipeline_functions"]["history"]
    history[-1] = tuple(float("nan") if i == which else v for i, v in enumerate(history[-1]))
    with pytest.raises(CheckFailed, match=message):
        check_pipeline_training(reports, data_file)
