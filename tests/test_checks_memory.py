"""Chapter 11 (making a model fit): the activation formula against autograd's saved tensors,
the planner, and the exercise checks, which pass on the solution and name each mistake
planted in a copy of it.

Exercise 1 runs the solution's worker on 2 ranks: one launch runs the solution's build()
and each planted copy of it (or of its training loop) in turn. Exercise 2 is a function,
planted and checked in-process.
"""

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spike_course import costmodel, launch, widgets
from spike_course.course import workers
from spike_course.checks import CheckFailed, check_fits_budget, check_peak_prediction, ch11_memory as memory
from named import mistake_of, names
from planting import answer_function
from spike_course.models import TinyTransformer

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "11_making_a_model_fit"
SOLUTION = course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb")
LECTURE = course_files.notebook(ROOT / "notebooks" / f"{STEM}.ipynb")
SCRIPTS = workers.worker_cells(SOLUTION)
TOOLS = SCRIPTS[f"{STEM}/memory_tools.py"]
FIT = SCRIPTS[f"{STEM}/fit_budget.py"]
BUDGET = int(re.search(r"^BUDGET = ([\d_]+)", SOLUTION.cells[1].source, re.M).group(1))
PEAK = next(c.source for c in SOLUTION.cells if c.source.startswith("def peak_bytes"))


def test_the_exercise_measures_with_the_lectures_tools():
    assert workers.worker_cells(LECTURE)[f"{STEM}/memory_tools.py"] == TOOLS
    assert "from memory_tools import" in FIT


# --- the cost model against what autograd saves ---


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "memory_tools.py").write_text(TOOLS)
    sys.path.insert(0, str(folder))
    import memory_tools
    yield memory_tools
    sys.path.remove(str(folder))


@pytest.mark.parametrize("precision", costmodel.PRECISIONS)
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("batch, seq, dim, hidden, layers, heads, vocab",
                         [(1, 8, 32, 64, 1, 4, 64), (3, 5, 64, 96, 3, 8, 100)])
def test_activation_formula_is_exact(tools, precision, checkpoint, batch, seq, dim, hidden, layers, heads, vocab):
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, hidden=hidden)
    if precision == "bf16":  # what MixedPrecisionPolicy computes with
        model = model.to(torch.bfloat16)
    if checkpoint:
        tools.checkpoint_blocks(model)
    x, y = torch.randint(0, vocab, (2, batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        _, saved = tools.saved_activation_bytes(lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    assert saved == costmodel.activation_bytes(batch, seq, dim, hidden, layers, heads, vocab, precision, checkpoint)


def test_parameter_count_is_the_models():
    assert costmodel.transformer_params(2, 32, 64, 64, 32) == sum(p.numel() for p in TinyTransformer().parameters())


def test_plan_shards_states_and_divides_by_tensor_parallel():
    one = costmodel.memory_plan("Llama 3 8B", 4096, 1)
    eight = costmodel.memory_plan("Llama 3 8B", 4096, 1, dp=8, shard=8)
    assert eight["optimizer"] == pytest.approx(one["optimizer"] / 8)
    assert eight["activations"] == one["activations"]
    tp = costmodel.memory_plan("Llama 3 8B", 4096, 1, tp=2)
    assert tp["parameters"] == pytest.approx(one["parameters"] / 2)
    assert tp["activations"] == pytest.approx(one["activations"] / 2)
    pp = costmodel.memory_plan("Llama 3 8B", 4096, 1, pp=2)  # 1F1B: stage 0 holds 2 micro-batches of half the layers
    assert pp["parameters"] == pytest.approx(one["parameters"] / 2) and pp["activations"] == one["activations"]
    offloaded = costmodel.memory_plan("Llama 3 8B", 4096, 1, offload=True)
    assert offloaded["parameters"] == 0 and offloaded["host"] == pytest.approx(16 * one["parameters"] / 4)
    assert costmodel.memory_plan("Llama 3 8B", 4096, 1, gpu_memory=1e12)["fits"]
    with pytest.raises(ValueError):
        costmodel.memory_plan("Llama 3 8B", 4096, 1, dp=8, shard=3)


def test_suggestions_make_it_fit_and_are_empty_when_it_does():
    job = dict(dp=8, shard=1, gpu_memory=0.5 * costmodel.B200_MEMORY)
    assert not costmodel.memory_plan("Llama 3 8B", 8192, 4, **job)["fits"]
    tips = costmodel.fit_suggestions("Llama 3 8B", 8192, 4, **job)
    assert tips and "checkpointing" in tips[0] and "still does not fit" not in tips[-1]
    assert costmodel.fit_suggestions("Llama 3.2 1B", 2048, 1, dp=8, shard=8) == []
    # offload moves the states to the host, but the activations of 64k tokens stay on the GPU
    assert "still does not fit" in costmodel.fit_suggestions("Llama 3 70B", 65536, 1, gpu_memory=20e9)[-1]


def test_planner_widget_draws_headless():
    box = widgets.memory_planner()
    box.children[0].children[0].value = "Llama 3 70B"  # redraws without error
    assert len(box.children) == 7


# --- exercise 1: fit a budget on 2 ranks ---

# Each mistake is planted in a copy of the solution's build(); to pay for one launch, not one
# per mistake, a single worker runs the solution and every planted copy in turn (the rest of
# the script, the unconstrained run included, is the solution's own text).
MPP = "mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
PLANTED = {
    "nothing sharded": ("    for block in model.layers:\n        fully_shard(block, mesh=mesh)     # states of each "
                        "block: 1/N per rank ...\n    fully_shard(model, mesh=mesh)  ", "    pass  ", "nothing is sharded"),
    "blocks not sharded": ("        fully_shard(block, mesh=mesh)  ", "        pass  ",
                           "the blocks layers.0, layers.1 are not FSDP units of their own"),
    # the same gathered bytes as "blocks not sharded": every block is whole after the forward
    "blocks kept gathered": ("        fully_shard(block, mesh=mesh)  ",
                             "        fully_shard(block, mesh=mesh, reshard_after_forward=False)  ",
                             r"layers.0, layers.1 are FSDP units, but .* \(reshard_after_forward=False"),
    "bf16 compute (MixedPrecisionPolicy)": (
        ("        fully_shard(block, mesh=mesh)  ", "    fully_shard(model, mesh=mesh)  "),
        (f"        fully_shard(block, mesh=mesh, {MPP})  ", f"    fully_shard(model, mesh=mesh, {MPP})  "),
        "the forward computed in torch.bfloat16"),
    # autocast around the forward saves neither what fp32 nor what the cost model's autocast
    # (which includes the loss) saves: once read as "whole model checkpointed"
    "bf16 compute (autocast)": ("\n    return model", "\n    model.forward = torch.autocast(ctx.device.type, "
                                "dtype=torch.bfloat16)(model.forward)\n    return model",
                                "the forward computed in torch.bfloat16, torch.float32"),
    "root not sharded": ("    fully_shard(model, mesh=mesh)         #", "    pass  #", "the root is not"),
    "no checkpointing": ("    checkpoint_blocks(model)  ", "    pass  ", "as much as without any"),
    "weights left uninitialised": ("    set_model_state_dict(", "    (lambda *a, **k: None)(",
                                     "does not start from the weights"),
    # checkpoint_blocks patches the forward of each entry of .layers: here, the whole model's
    "whole model checkpointed": ("    checkpoint_blocks(model)  ",
                                 '    checkpoint_blocks(type("Whole", (), {"layers": [model]}))  ',
                                 "whole model is checkpointed"),
    "cast to bf16": ("\n    return model", "\n    model.to(torch.bfloat16)\n    return model", "master weights"),
    # the lecture's recipe copied whole: its class, and no buffer to compute again
    "another class": (("model = PositionalTransformer(**SHAPE)", "    model.position_signal.copy_("),
                      ("model = TinyTransformer(**SHAPE)", "    (lambda *a: None)("), "the colleague's model"),
    "created whole": ('with torch.device("meta"):', "with torch.device(ctx.device):", "created the whole model"),
    "buffer left uninitialised": ("    model.position_signal.copy_(", "    (lambda *a: None)(",
                                  "persistent=False is in no state dict"),
}
# A learner may change the training loop the script gives too: these are planted in a copy of
# train() that trains the solution's build() (the unconstrained run keeps the solution's train()).
PLANTED_IN_TRAIN = {
    "accumulated micro-batches": (
        "        loss, saved = saved_activation_bytes(lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()))\n"
        "        in_forward = local_bytes(model.parameters())  # FSDP units still gathered after the forward\n"
        "        loss.backward()\n",
        "        for x, y in zip(x.chunk(2), y.chunk(2)):  # 2 micro-batches of 4, gradients accumulated\n"
        "            loss, saved = saved_activation_bytes(lambda: F.cross_entropy(model(x).flatten(0, 1), "
        "y.flatten()) / 2)\n"
        "            in_forward = local_bytes(model.parameters())\n"
        "            loss.backward()\n",
        "the forward saw 4 sequences, the unconstrained run's 8"),
}
MISTAKES = {**PLANTED, **PLANTED_IN_TRAIN}
CHECK_MODULE = memory  # PLANTS below: each key a mistake's name, or a name and (how), planted (tests/named.py)
HEAD, _, REST = FIT.partition("\ndef build(")
TRAIN = "def train(" + HEAD.partition("\ndef train(")[2]
BUILD, _, MAIN = ("def build(" + REST).partition("\nunconstrained = ")
BUILD_CALL = "model = build(dict(initial) if ctx.is_main else {})\n"  # the worker's one call of build()
BODY, _, TAIL = ("unconstrained = " + MAIN).partition(BUILD_CALL)


def planted(source, old, new):
    for before, after in zip(old, new) if isinstance(old, tuple) else [(old, new)]:
        assert before in source, f"the solution no longer contains {before!r}: update this test"
        source = source.replace(before, after, 1)
    return source


def variants_script():
    """The worker, running for each name in MISTAKES (and "solution") its build() and train()."""
    builds = {"solution": BUILD, **{name: planted(BUILD, old, new) for name, (old, new, _) in PLANTED.items()}}
    trains = {name: planted(TRAIN, old, new) for name, (old, new, _) in PLANTED_IN_TRAIN.items()}
    defs = "".join(source.replace("def build(", f"def build_{i}(", 1) + "\n"
                   for i, source in enumerate(builds.values()))
    defs += "".join(source.replace("def train(", f"def train_{i}(", 1) + "\n"
                    for i, source in enumerate(trains.values()))
    table = ", ".join([*(f"{name!r}: (build_{i}, train)" for i, name in enumerate(builds)),
                       *(f"{name!r}: (build_0, train_{i})" for i, name in enumerate(trains))])
    body, teardown = TAIL.rsplit("runtime.teardown()", 1)
    loop = ("_report = runtime.report\n"
            f"for _name, (build, train) in {{{table}}}.items():\n"
            "    runtime.report = lambda **values: _report(**{_name: values})\n"
            "    " + BUILD_CALL + "".join(f"    {line}\n" for line in body.strip().splitlines()))
    return HEAD + "\n" + defs + "\n" + BODY + loop + "runtime.teardown()" + teardown


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fit_budget")
    (folder / "memory_tools.py").write_text(TOOLS)
    (folder / "fit_budget.py").write_text(variants_script())
    results = launch(str(folder / "fit_budget.py"), nproc=2, echo=False, progress=False).reports
    return {name: {rank: results[rank][name] for rank in results} for name in ["solution", *MISTAKES]}


@pytest.fixture
def solution_results(runs):
    return runs["solution"]


@pytest.mark.processes
def test_solution_fits(solution_results, capsys):
    check_fits_budget(solution_results, BUDGET)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_planted_mistake_is_named(runs, name):
    with names(mistake_of(name), says=MISTAKES[name][2]):
        check_fits_budget(runs[name], BUDGET)


@pytest.mark.processes
def test_bytes_alone_would_name_a_neighbour(runs):
    """Why the worker reports its FSDP units and what its forward computed in. No FSDP unit per
    block, or units that stay gathered after their forward: the same gathered bytes. Autocast
    around the forward saves less than an fp32 forward checkpointed per block, as checkpointing
    the whole model does. (And a bf16 forward saves about what two fp32 micro-batches of half
    the batch save: 59,778 and 59,780 bytes here.)"""
    gathered = [runs[name][0]["fit"]["gathered"] for name in ("blocks not sharded", "blocks kept gathered")]
    assert gathered[0] == gathered[1], gathered
    per_block = costmodel.activation_bytes(8, 16, 32, 64, 2, 4, 64, checkpoint=True)
    assert runs["bf16 compute (autocast)"][0]["fit"]["saved"] < per_block


# --- exercise 2: predict the peak ---


def planted_peak(old="", new=""):
    return answer_function(PEAK.split("\nprint(")[0], "peak_bytes", old, new, {"costmodel": costmodel})


def test_peak_solution_passes(capsys):
    check_peak_prediction(planted_peak())
    assert "check passed" in capsys.readouterr().out


PEAK_MISTAKES = {  # a mistake of exercise 2's table -> (old, new) in the solution, what is said
    "micro-batch not divided by the accumulation": ("global_batch // (gpus * accumulation)", "global_batch // gpus",
                                                    "AND by the accumulation"),
    "the whole global batch in one forward": ("global_batch // (gpus * accumulation)", "global_batch",
                                              "not the whole global batch"),
    "states not sharded": ("zero_memory_breakdown(psi, shard, 3", "zero_memory_breakdown(psi, 1, 3",
                           "each GPU holds 1/F"),
    "states sharded over every GPU": ("zero_memory_breakdown(psi, shard, 3", "zero_memory_breakdown(psi, gpus, 3",
                                      "not over all of them"),
    "no optimizer state": ("k=8,", "k=0,", "Adam's two moments"),
    "checkpointing ignored": ("checkpoint=checkpoint)", "checkpoint=False)", "ignore checkpointing"),
    "activations in fp32": ("precision=precision,", "", "counted in fp32"),
    "no fp32 master weights": ("param_bytes=4, grad_bytes=4", "param_bytes=2, grad_bytes=2", "fp32 master weights"),
}
PLANTS = {**MISTAKES, **PEAK_MISTAKES}


@pytest.mark.parametrize("name", PEAK_MISTAKES)
def test_peak_mistakes_are_named(name):
    old, new, message = PEAK_MISTAKES[name]
    with names(name, says=message):
        check_peak_prediction(planted_peak(old, new))


def test_calling_the_whole_memory_plan_is_not_an_answer():
    from spike_course import costmodel

    def by_name(model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint):
        micro = global_batch // (gpus * accumulation)
        return costmodel.memory_plan(model, seq, micro, dp=gpus, shard=shard, precision=precision,
                                     checkpoint=checkpoint)["total"]

    plan = costmodel.memory_plan  # an alias hides the name, not the function

    def by_alias(*job):
        model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint = job
        return plan(model, seq, global_batch // (gpus * accumulation), dp=gpus, shard=shard,
                    precision=precision, checkpoint=checkpoint)["total"]

    def by_pieces(*job):  # getattr with a name built from pieces: the call is still recorded
        return by_alias(*job) * 0 + getattr(costmodel, "memory_" + "plan")(*job[:2], 1)["total"] * 0 + by_name(*job)

    for answer in (by_name, by_alias, by_pieces):
        with pytest.raises(CheckFailed, match=r"BorrowedAnswer: peak_bytes calls memory_plan, the course's own answer"):
            check_peak_prediction(answer)


def test_each_slip_of_exercise_2_is_told_apart_on_the_checks_jobs():
    """A slip is judged on the first job where it changes the total; there, no other slip may
    give the same total, or the check would name the wrong one."""
    from spike_course.checks.ch11_memory import PEAK_JOBS, PEAK_SLIP_CHANGES, _Peak
    from spike_course.costmodel import memory_plan

    def expected(job):
        model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint = job
        return memory_plan(model, seq, global_batch // (gpus * accumulation), dp=gpus, shard=shard,
                           precision=precision, checkpoint=checkpoint)["total"]

    def total(job, slip):
        return _Peak(job, 0, expected(job)).total(**PEAK_SLIP_CHANGES[slip][1])

    for slip in PEAK_SLIP_CHANGES:
        job = next((j for j in PEAK_JOBS if total(j, slip) != expected(j)), None)
        assert job is not None, f"no job of the check shows this slip: {slip}"
        value = total(job, slip)
        twins = [other for other in PEAK_SLIP_CHANGES
                 if other != slip and abs(total(job, other) - value) <= 1e-9 * value]
        assert not twins, f"on {job} '{slip}' reads like {twins}"
