"""Chapter 08's check passes on the solution and names each mistake planted in a copy of it.

The solution's answers (ring_from_fit, predict_allreduce, dgx_busbw and dgx_allreduce_seconds)
are the code between its solution markers; each test replaces one line of that code, runs it
and asserts the check's message. The fit stands for a learner's measurement on 2 ranks; no
launch is needed. The check names a slip by its results on jobs it chooses, so the tables of
slips are also tested for two slips with the same results on every job.
"""

import itertools
from pathlib import Path

import pytest
import torch

from spike_course import costmodel
from spike_course.course import conventions
from spike_course.checks import CheckFailed, check_dgx_prediction
from spike_course.checks import _guard
from spike_course.checks import ch08_communication as check
from named import mistake_of, names

import course_files

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = course_files.notebook(ROOT / "solutions" / "08_communication_and_hardware.ipynb")
SOLUTION = "\n".join(cell.source for cell in NOTEBOOK.cells
                     if cell.cell_type == "code" and conventions.has_solution(cell))
FIT, WORLD = (900e-6, 1 / 0.3e9), 2  # a laptop's gloo all-reduce: 900 us, 0.3 GB/s


def run(old="", new="", solution=SOLUTION):
    assert old in solution, f"the solution no longer contains {old!r}: update this test"
    # the notebook's imports and the measurement's results, as the cells above the answers leave them
    namespace = {"torch": torch, "costmodel": costmodel, "alpha": FIT[0], "beta": FIT[1], "world": WORLD}
    exec(solution.replace(old, new, 1), namespace)  # noqa: S102 - the course's own solution
    check_dgx_prediction(namespace["ring_from_fit"], namespace["predict_allreduce"], namespace["dgx_busbw"],
                         namespace["dgx_allreduce_seconds"], fit=FIT, world_size=WORLD)


def test_solution_passes(capsys):
    run()
    assert "check passed" in capsys.readouterr().out


DGX_CALL = "return predict_allreduce(num_params, grad_dtype, gpus, DGX_STEP_LATENCY, dgx_busbw)"
# name: (line of the solution, the line with the mistake, what the message must say)
MISTAKES = {
    # part 1, ring_from_fit
    "alpha is not per step": ("step_latency = alpha / steps", "step_latency = alpha", "is alpha itself"),
    "one pass of steps": ("step_latency = alpha / steps", "step_latency = alpha / (world_size - 1)",
                          "divided alpha by N-1"),
    "algorithm bandwidth from the fit": ("busbw = steps / world_size / beta", "busbw = 1 / beta",
                                         "is the algorithm bandwidth"),
    "bus factor upside down": ("busbw = steps / world_size / beta", "busbw = world_size / steps / beta",
                               "upside down"),
    # part 2, predict_allreduce
    "latency once": ("return steps * step_latency +", "return step_latency +", "the latency counts once"),
    "latency of one pass": ("return steps * step_latency +", "return (world_size - 1) * step_latency +",
                            "N-1 steps are one pass"),
    "algorithm bandwidth in the prediction": ("+ steps / world_size * nbytes / busbw", "+ nbytes / busbw",
                                              "buffer sent once"),
    "bytes of one pass": ("+ steps / world_size * nbytes / busbw",
                          "+ (world_size - 1) / world_size * nbytes / busbw", "carries \\(N-1\\)/N of the buffer"),
    "whole buffer every step": ("+ steps / world_size * nbytes / busbw", "+ steps * nbytes / busbw",
                                "sends the whole buffer"),
    "parameters not bytes": ("nbytes = num_params * torch", "nbytes = num_params  # * torch",
                             "counted parameters, not bytes"),
    "always fp32": ("nbytes = num_params * torch", "nbytes = num_params * 4  # torch",
                    "4 bytes per gradient whatever"),
    "bits for bytes in the prediction": ("torch.tensor([], dtype=grad_dtype).element_size()",
                                         "torch.finfo(grad_dtype).bits", "bits where bytes were meant"),
    # part 3, dgx_busbw
    "one NVLink": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 400e9 / 8", "one NVLink's bandwidth"),
    "bits for bytes": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 18 * 400e9", "400 Gbit/s is in bits"),
    "one link, in bits": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 400e9", "one link's 400 Gbit/s, taken as bytes"),
    "both directions": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 2 * 18 * 400e9 / 8", "other direction"),
    "both directions (the headline figure)": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 1.8e12", "other direction"),
    "a direction split in two": ("dgx_busbw = 18 * 400e9 / 8", "dgx_busbw = 18 * 400e9 / 8 / 2",
                                 "sending does not take from its receiving"),
    # part 3, dgx_allreduce_seconds (given a right predict_allreduce and dgx_busbw)
    "fp32 gradients on the DGX": (DGX_CALL, DGX_CALL.replace("grad_dtype", "torch.float32"),
                                  "4 bytes per gradient whatever grad_dtype"),
    "bf16 whatever the dtype": (DGX_CALL, DGX_CALL.replace("grad_dtype", "torch.bfloat16"),
                                "bf16 whatever grad_dtype"),
    "bytes passed as parameters": (DGX_CALL, DGX_CALL.replace(
        "(num_params,", "(num_params * torch.tensor([], dtype=grad_dtype).element_size(),"), "counted twice"),
    "parameters not bytes on the DGX": (DGX_CALL, "return 2 * (gpus - 1) * (DGX_STEP_LATENCY + num_params / gpus "
                                                  "/ dgx_busbw)", "counted parameters, not bytes"),
    "algorithm bandwidth on the DGX": (DGX_CALL, "return 2 * (gpus - 1) * DGX_STEP_LATENCY + num_params * "
                                                 "torch.tensor([], dtype=grad_dtype).element_size() / dgx_busbw",
                                       "buffer sent once"),
    "always 8 GPUs": (DGX_CALL, DGX_CALL.replace("gpus,", "8,"), "the same on 4 GPUs as on 8"),
    "the measurement's world size": (DGX_CALL, DGX_CALL.replace("gpus,", "world,"), "a ring of 2 ranks whatever"),
    "this machine's ring": (DGX_CALL, DGX_CALL.replace("DGX_STEP_LATENCY, dgx_busbw",
                                                       "*ring_from_fit(alpha, beta, world)"), "this machine's ring"),
    "this machine's latency": (DGX_CALL, DGX_CALL.replace("DGX_STEP_LATENCY", "ring_from_fit(alpha, beta, world)[0]"),
                               "the latency per step is this machine's"),
    "the 8B model whatever": (DGX_CALL, DGX_CALL.replace("(num_params,", "(8.0e9,"), "the 8B model whatever"),
}


ACROSS = "across = predict_allreduce(num_params / 8, grad_dtype, nodes, IB_STEP_LATENCY, 400e9 / 8)"
TWO_LEVEL_MISTAKES = {  # part 4, two_level_allreduce_seconds
    "the whole buffer across the nodes": (ACROSS, ACROSS.replace("num_params / 8,", "num_params,"),
                                          "only that eighth travels"),
    "8 times too fast across the nodes": (ACROSS, ACROSS.replace("400e9 / 8)", "8 * 400e9 / 8)"), "all 8 NICs"),
    "8 times too fast across the nodes (bits)": (ACROSS, ACROSS.replace("400e9 / 8)", "400e9)"), "read as bytes"),
    "no all-gather": ("return inside + across + inside", "return inside + across", "the all-gather"),
    "one pass across the nodes": (ACROSS, "across = (nodes - 1) * IB_STEP_LATENCY + (nodes - 1) / nodes * num_params "
                                          "* torch.tensor([], dtype=grad_dtype).element_size() / 8 / (400e9 / 8)",
                                  "two passes around the ring of nodes"),
    "the node's latency across the nodes": (ACROSS, ACROSS.replace("IB_STEP_LATENCY", "DGX_STEP_LATENCY"),
                                            "paid NVLink's latency"),
}


def run_two_levels(old="", new=""):
    assert old in SOLUTION, f"the solution no longer contains {old!r}: update this test"
    namespace = {"torch": torch, "costmodel": costmodel, "alpha": FIT[0], "beta": FIT[1], "world": WORLD}
    exec(SOLUTION.replace(old, new, 1), namespace)  # noqa: S102 - the course's own solution
    check.check_two_level_allreduce(namespace["two_level_allreduce_seconds"])


def test_the_two_level_solution_passes(capsys):
    run_two_levels()
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(TWO_LEVEL_MISTAKES))
def test_each_two_level_mistake_is_named(name):
    old, new, message = TWO_LEVEL_MISTAKES[name]
    with names(mistake_of(name), says=message):
        run_two_levels(old, new)


CHECK_MODULE, PLANTS = check, {**MISTAKES, **TWO_LEVEL_MISTAKES}  # tests/named.py


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named(name):
    old, new, message = MISTAKES[name]
    with names(mistake_of(name), says=message):
        run(old, new)


# Pairs that one number (or the check's former jobs, 2 ranks in bf16 first) could not tell apart:
# the same factor for two mistakes. Each is planted above; here neither is named for the other.
FORMER_COLLISIONS = [
    ("both directions", "parameters not bytes"), ("both directions", "parameters not bytes on the DGX"),
    ("algorithm bandwidth on the DGX", "the measurement's world size"),
    ("algorithm bandwidth in the prediction", "the measurement's world size"),
    ("fp32 gradients on the DGX", "bytes passed as parameters"),
    ("fp32 gradients on the DGX", "a direction split in two"),
    ("parameters not bytes", "bytes of one pass"), ("always fp32", "whole buffer every step"),
    ("bits for bytes in the prediction", "whole buffer every step"), ("latency once", "latency of one pass"),
]


@pytest.mark.parametrize("first, second", FORMER_COLLISIONS)
def test_former_neighbours_are_not_named_for_each_other(first, second):
    for planted, other in ((first, second), (second, first)):
        with pytest.raises(CheckFailed) as failure:
            run(*MISTAKES[planted][:2])
        assert failure.value.mistake == mistake_of(planted), f"{planted} was named {failure.value.mistake}"


def _results(formulas, jobs, context=()):
    return [[formula(*job, *context) for job in jobs] for formula in formulas]


def _apart(a, b):
    return any(abs(x - y) > check.RTOL * max(abs(x), abs(y)) for x, y in zip(a, b))


TABLES = {  # each table of slips with the reference, the jobs the check runs it on (and the slips' context)
    "ring latency": (lambda *j: check._ring(*j)[0], check.STEP_LATENCY_SLIPS,
                     [(20e-6, 1 / 3e9, 4), (4e-6, 1 / 40e9, 8), (*FIT, WORLD)]),
    "ring bus bandwidth": (lambda *j: check._ring(*j)[1], check.BUS_BANDWIDTH_SLIPS,
                           [(20e-6, 1 / 3e9, 4), (4e-6, 1 / 40e9, 8), (*FIT, WORLD)]),
    "prediction latency": (lambda p, d, n, a, bw: check._predict(p, check._size(d), n, a, bw), check.LATENCY_SLIPS,
                           [(0, torch.bfloat16, n, 3e-6, 100e9) for n in (8, 4)]),
    "prediction bytes": (lambda p, d, n, a, bw: check._predict(p, check._size(d), n, a, bw), check.BYTES_SLIPS,
                         [(1e9, torch.bfloat16, 8, 0.0, 100e9), (1e9, torch.float32, 8, 0.0, 100e9),
                          (1e9, torch.bfloat16, 4, 0.0, 100e9)]),
    "node bus bandwidth": (lambda: check.DGX_BUSBW, check.DGX_BUSBW_SLIPS, [()]),
    "two levels": (check._two_level, check.TWO_LEVEL_SLIPS,
                   [(0, torch.bfloat16, 2), (0, torch.bfloat16, 4), (8e9, torch.bfloat16, 2),
                    (8e9, torch.float32, 2), (8e9, torch.bfloat16, 4)]),
    "node all-reduce": (lambda p, d, n: check._predict(p, check._size(d), n, check.NCCL_ALPHA, check.DGX_BUSBW),
                        check.DGX_SLIPS,
                        [(0, torch.bfloat16, 8), (0, torch.bfloat16, 4), (8e9, torch.bfloat16, 8),
                         (8e9, torch.float32, 8), (8e9, torch.bfloat16, 4)], (*check._ring(*FIT, WORLD), WORLD)),
}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_no_two_slips_give_the_same_results_on_the_checks_jobs(table):
    reference, slips, jobs, *context = TABLES[table]
    context = context[0] if context else ()
    results = [_results([reference], jobs)[0]] + _results([slip.seen.results for slip in slips], jobs, context)
    for (i, a), (j, b) in itertools.combinations(enumerate(results), 2):
        assert _apart(a, b), f"{table}: {'the right answer' if i == 0 else slips[i - 1].name!r} and " \
                             f"{slips[j - 1].name!r} give the same results on every job"


def _names(slips):
    return tuple(slip.name for slip in slips)


def test_the_tables_jobs_are_the_checks(monkeypatch):
    """The jobs above are the ones the check calls the answers with (else the test of the tables
    would prove nothing)."""
    seen, original = {}, check._name_the_slip

    def spy(answer, reference, slips, jobs, show, otherwise, context=()):
        seen[_names(slips)] = list(jobs)
        return original(answer, reference, slips, jobs, show, otherwise, context)

    monkeypatch.setattr(check, "_name_the_slip", spy)
    with _guard.trusting_a_spy():  # the spy is the test's, not an answer's: the checks may trust it
        run()
        run_two_levels()
    assert {_names(slips): jobs for _, slips, jobs, *_ in TABLES.values()} == seen


CORRECT_ELSEWISE = '''
def ring_from_fit(alpha, beta, world_size):
    hops = world_size - 1
    return alpha / hops / 2, 2 * hops / (world_size * beta)


def predict_allreduce(num_params, grad_dtype, world_size, step_latency, busbw):
    bits = torch.finfo(grad_dtype).bits
    return 2 * (world_size - 1) * (step_latency + num_params * bits / 8 / world_size / busbw)


DGX_STEP_LATENCY = costmodel.NCCL_ALPHA
dgx_busbw = 1.8e12 / 2  # the headline adds both directions


def dgx_allreduce_seconds(num_params, grad_dtype, gpus):
    chunk = num_params * torch.tensor([], dtype=grad_dtype).element_size() / gpus
    return 2 * (gpus - 1) * (DGX_STEP_LATENCY + chunk / dgx_busbw)
'''


def test_a_correct_answer_written_otherwise_passes(capsys):
    run(solution=CORRECT_ELSEWISE)
    assert "check passed" in capsys.readouterr().out


def test_the_cost_models_collective_time_is_not_an_answer():
    """Part 3 written with the course's own collective time, reached by a name in pieces."""
    borrowed = CORRECT_ELSEWISE.split("def dgx_allreduce_seconds")[0] + (
        "def dgx_allreduce_seconds(num_params, grad_dtype, gpus):\n"
        "    nbytes = num_params * torch.tensor([], dtype=grad_dtype).element_size()\n"
        "    return getattr(costmodel, 'collective_' + 'time')('all_reduce', nbytes, gpus, dgx_busbw, DGX_STEP_LATENCY)\n")
    with pytest.raises(CheckFailed, match="BorrowedAnswer: your answer calls collective_time"):
        run(solution=borrowed)


def test_the_right_8b_figure_alone_fails():
    """A function that returns the right figure for the 8B model whatever it is asked."""
    right = check._predict(8.0e9, 2, 8, costmodel.NCCL_ALPHA, 900e9)
    with pytest.raises(CheckFailed, match=r"dgx_allreduce_seconds\(0 parameters, bfloat16, 8 GPUs\)"):
        run(DGX_CALL, f"return {right!r}")


TRIVIAL = '''
def ring_from_fit(alpha, beta, world_size):
    return 0.0, 1.0


def predict_allreduce(num_params, grad_dtype, world_size, step_latency, busbw):
    return 0.0


dgx_busbw = 1.0


def dgx_allreduce_seconds(num_params, grad_dtype, gpus):
    return 0.0
'''


def test_a_trivial_answer_fails():
    with pytest.raises(CheckFailed, match="latency per step 0 s"):
        run(solution=TRIVIAL)


def test_the_blank_is_named():
    def blank(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_dgx_prediction(blank, blank, None, blank, fit=FIT, world_size=WORLD)
