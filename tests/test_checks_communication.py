"""Chapter 08's check passes on the solution and names each mistake planted in a copy of it.

The solution's three answers (ring_from_fit, predict_allreduce, dgx_busbw and dgx_seconds)
are the code between its solution markers; each test replaces one line of that code, runs it
and asserts the check's message. The fit stands for a learner's measurement on 2 ranks; no
launch is needed.
"""

from pathlib import Path

import nbformat
import pytest
import torch

from spike_course import costmodel, exercises
from spike_course.checks import CheckFailed, check_dgx_prediction

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = nbformat.read(ROOT / "solutions" / "08_communication_and_hardware.ipynb", as_version=4)
SOLUTION = "\n".join(cell.source for cell in NOTEBOOK.cells
                     if cell.cell_type == "code" and exercises.has_solution(cell))
FIT, WORLD = (900e-6, 1 / 0.3e9), 2  # a laptop's gloo all-reduce: 900 us, 0.3 GB/s


def run(old="", new=""):
    assert old in SOLUTION, f"the solution no longer contains {old!r}: update this test"
    namespace = {"torch": torch, "costmodel": costmodel}  # the notebook's imports
    exec(SOLUTION.replace(old, new, 1), namespace)  # noqa: S102 - the course's own solution
    check_dgx_prediction(namespace["ring_from_fit"], namespace["predict_allreduce"],
                         namespace["dgx_seconds"], fit=FIT, world_size=WORLD)


def test_solution_passes(capsys):
    run()
    assert "check passed" in capsys.readouterr().out


MISTAKES = {
    "alpha is not per step": ("step_latency = alpha / steps", "step_latency = alpha", "divide by 2\\(N-1\\)"),
    "one pass of steps": ("step_latency = alpha / steps", "step_latency = alpha / (world_size - 1)",
                          "divided alpha by N-1"),
    "algorithm bandwidth from the fit": ("busbw = steps / world_size / beta", "busbw = 1 / beta",
                                         "is the algorithm bandwidth"),
    "bus factor upside down": ("busbw = steps / world_size / beta", "busbw = world_size / steps / beta",
                               "upside down"),
    "latency once": ("return steps * step_latency +", "return step_latency +", "the latency counts once"),
    "algorithm bandwidth in the prediction": ("+ steps / world_size * nbytes / busbw", "+ nbytes / busbw",
                                              "buffer sent once"),
    "parameters not bytes": ("nbytes = num_params * torch", "nbytes = num_params  # * torch",
                             "counted parameters, not bytes"),
    "always fp32": ("nbytes = num_params * torch", "nbytes = num_params * 4  # torch",
                    "4 bytes per gradient whatever"),
    "one NVLink": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 400e9 / 8", "one NVLink's bandwidth"),
    "bits for bytes": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 18 * 400e9", "is in bits"),
    "both directions": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 2 * 18 * 400e9 / 8", "other direction"),
    "fp32 gradients on the DGX": ("predict_allreduce(8.0e9, torch.bfloat16,",
                                  "predict_allreduce(8.0e9, torch.float32,",
                                  "not 4 \\(fp32\\)"),
}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named(name):
    old, new, message = MISTAKES[name]
    with pytest.raises(CheckFailed, match=message):
        run(old, new)


def test_the_blank_is_named():
    def blank(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_dgx_prediction(blank, blank, None, fit=FIT, world_size=WORLD)
