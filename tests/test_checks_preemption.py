"""Chapter 14's exercise: check_preemption_safe passes the solution's safe_train.py under its
drill (SIGTERM to both ranks, SIGTERM to one, SIGKILL, a half-written checkpoint) and names
each classic mistake.

Every mistake is planted in a copy of the solution's safe_train.py (a line of its solution
region changed), written next to the exercise's own job_parts.py; the uninterrupted
plain_train.py run is launched once for the module. One drill per mistake: a few 2-rank warm
launches, about 1 s, or 4 s when the mistake makes the job hang until the grace period ends.

What would go wrong only on a GPU node (a checkpoint without the GPU's generator state, a
background save on a group without a CPU backend) is named from the probe's readings of the
saves: here from readings as a GPU node records them, and from a real drill where there is a GPU."""

import re
import signal
from pathlib import Path

import pytest
import torch

import spike_course
from spike_course.course import conventions, workers
from spike_course.checks import CheckFailed, check_preemption_safe, ch14_preemption as preemption
from spike_course.lab import preemption_probe
from spike_course.lab.launcher import LaunchResult
from spike_course.checks._common import name_the_first
from named import names
from spike_course.course.conventions import written_file
from planting import planted

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "14_surviving_preemption"
NOTEBOOK = course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb")
CELLS = workers.worker_cells(NOTEBOOK)
SAFE = written_file(NOTEBOOK, f"workers/{STEM}/safe_train.py")
STEPS = 30


HANDLER = "signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))"
AGREE = "dist.all_reduce(anyone, op=dist.ReduceOp.MAX)"
EXIT = '''if in_flight is not None:
    in_flight.result()
    seal(in_flight_step)
if in_flight_step != job.step and start != job.step:
    dcp.save(everything, storage_writer=where(job.step), process_group=writer_group)
    seal(job.step)'''
MISTAKES = {
    "blank": (None, r"safe_train.py is not written yet"),
    "no_handler": ((HANDLER, "pass"), r"SIGTERM ended rank \d at once \(exit code -15\): nothing caught the signal"),
    "saving_inside_the_handler": ((HANDLER, '''def save_now(signum, frame):
    received.append(signum)
    dcp.save(everything, storage_writer=where(job.step), process_group=writer_group)
    seal(job.step)


signal.signal(signal.SIGTERM, save_now)'''), r"hung inside a step.*started from the signal handler"),
    "rank_0_alone_decides": ((AGREE, "dist.broadcast(anyone, src=0)"),
                             r"only rank 1 received SIGTERM.*ignored that rank's flag \(rank 0 alone decided\?\)"),
    "each_rank_decides_alone": ((AGREE, "pass"), r"stopped at different steps.*decided to stop by itself"),
    "rng_state_not_saved": (('torch.set_rng_state(states["cpu"])', "pass"),
                            r"drew other random numbers than the uninterrupted run"),
    "async_save_on_the_default_group": (
        ("in_flight = dcp.async_save(everything, storage_writer=where(job.step), process_group=writer_group)",
         "in_flight = dcp.async_save(everything, storage_writer=where(job.step))"),
        r"dcp\.async_save ran on the default process group.*on a GPU node, where the default group is NCCL only"),
    "data_position_not_saved": (("itertools.islice(loader, skip, skip + args.steps - job.step)",
                                 "itertools.islice(loader, 0, args.steps - job.step)"),
                                r"does not continue at the data position it stopped at"),
    "half_written_checkpoint_loaded": (('if (p / "COMPLETE").exists()', "if p.is_dir()"),
                                       r"step_999999, a checkpoint folder whose save never finished"),
    "async_future_never_awaited": ((EXIT, '''if in_flight_step != job.step and start != job.step:
    in_flight = dcp.async_save(everything, storage_writer=where(job.step), process_group=writer_group)'''), r"dcp\.async_save.*\(Hint 4\)"),
    "scheduler_not_restored": (('everything = {"job": job, "schedule": scheduler}', 'everything = {"job": job}'),
                               r"used learning rate .* the schedule's position in the scheduler's own state_dict"),
    "optimizer_not_restored": (('set_optimizer_state_dict(model, optimizer, saved["moments"])', "pass"),
                               # the rate shows it first when a resumed run crosses step 7, 14, ...; else the momentum
                               r"(used learning rate .* the optimizer's param_groups \(restored with the optimizer's state"
                               r"|computed another loss.*the optimizer's state \(SGD's momentum\))"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    for name in ("job_parts.py", "plain_train.py"):
        (folder / name).write_text(CELLS[f"{STEM}/{name}"])
    job = spike_course.launch(folder / "plain_train.py", nproc=2, omp_threads=1, echo=False, progress=False,
                              args=["--steps", STEPS])
    return job.reports


def drill(worker, source, reference):
    worker(CELLS[f"{STEM}/job_parts.py"], "job_parts.py")
    check_preemption_safe(worker(source, "safe_train.py"), reference, steps=STEPS, threads=1)


@pytest.mark.processes
def test_the_solution_passes_the_drill(worker, no_orphans, reference, capsys, tmp_path):
    drill(worker, SAFE, reference)
    assert "the final weights equal the uninterrupted run's bit for bit" in capsys.readouterr().out
    # What the probe saw of the last launch's saves: the background ones on a gloo group of the
    # script's own, and every one holding the rank's generator states.
    saves = preemption._saves(tmp_path / "drill" / "saves")
    assert {s["call"] for s in saves} == {"async_save", "save"}
    assert all(s["cpu_backend"] and s["cpu_generator"] for s in saves)
    assert not any(s["default_group"] for s in saves if s["call"] == "async_save")
    on_gpu = torch.cuda.is_available()
    assert all(s["device"] == ("cuda" if on_gpu else "cpu") and s["gpu_generator"] is (True if on_gpu else None)
               for s in saves)


GPU_GENERATOR = 'states["cuda"] = torch.cuda.get_rng_state(ctx.device)'


@pytest.mark.processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's generator exists on a GPU node only")
def test_a_checkpoint_without_the_gpus_generator_is_named_on_a_gpu(worker, no_orphans, reference):
    with pytest.raises(CheckFailed, match=r"does not hold that GPU's random generator state"):
        drill(worker, planted(SAFE, (GPU_GENERATOR, "pass")), reference)


# One reading of the probe per save, as a GPU node would record them: what a laptop cannot show.
ON_A_GPU = {"call": "async_save", "default_group": False, "cpu_backend": True, "device": "cuda",
            "cpu_generator": True, "gpu_generator": True}
GPU_READINGS = {
    "GPU generator not saved": ({"gpu_generator": False}, r"does not hold that GPU's random generator state.*Hint 5"),
    "async save group without a CPU backend": ({"cpu_backend": False},
                                                r"group without a CPU backend.*NCCL on a GPU node.*Hint 4"),
    "async save on the default group": ({"default_group": True, "cpu_backend": False},
                                        r"default process group.*A CPU backend must be enabled"),
}


# The save table's mistakes, planted in the probe's readings (the drill's launches and readings
# made by hand plant the others: PLANTS, below).
CHECK_MODULE = preemption  # tests/named.py


@pytest.mark.parametrize("mistake", sorted(GPU_READINGS))
def test_a_gpu_save_mistake_is_named_from_the_probes_readings(mistake):
    change, message = GPU_READINGS[mistake]
    name_the_first(preemption.SAVE_MISTAKES, [ON_A_GPU, ON_A_GPU])  # the solution's, on a GPU: nothing to name
    with names(mistake, says=re.compile(message, re.S)):
        name_the_first(preemption.SAVE_MISTAKES, [ON_A_GPU, {**ON_A_GPU, **change}])


def test_periodic_saves_that_block_the_training_are_named():
    """The statement asks for background saves: a blocking save before the drill's signal that
    is not the rank's last is a periodic one, named; the solution's blocking save at the end,
    or saves after the signal (in a handler, at exit), are not periodic."""
    blocking = {**ON_A_GPU, "call": "save", "after_signal": False}
    background = {**ON_A_GPU, "after_signal": False}
    upload = {**blocking, "main_thread": False}  # async_save's own save, in its upload thread
    fine = [{**background, "rank": 0}, {**upload, "rank": 0}, {**blocking, "rank": 0},  # ...its final save
            {**blocking, "rank": 1, "after_signal": True}, {**blocking, "rank": 1, "after_signal": True}]
    name_the_first(preemption.SAVE_MISTAKES, fine)
    with names("periodic saves block the training",
               says=r"periodic checkpoint .* with dcp\.save.*in the background.*Hint 4"):
        name_the_first(preemption.SAVE_MISTAKES, [{**blocking, "rank": 1}, {**background, "rank": 1}])


def test_the_probe_finds_a_generator_state_anywhere_in_the_saved_state():
    """The solution's state as DCP receives it, with a 16-byte CUDA generator state (seed and
    offset) standing in for torch.cuda.get_rng_state(): found when it is there, and only then."""
    gpu_state = torch.arange(16, dtype=torch.uint8)
    state = {"job": {"step": 4, "weights": {"0.weight": torch.zeros(2, 2)},
                     "generators1": {"cpu": torch.get_rng_state(), "cuda": gpu_state.clone()}},
             "schedule": {"last_epoch": 4}}
    assert preemption_probe._holds(state, gpu_state)
    assert preemption_probe._holds(state, torch.get_rng_state())
    del state["job"]["generators1"]["cuda"]
    assert not preemption_probe._holds(state, gpu_state)
    assert not preemption_probe._holds(state, torch.arange(1, 17, dtype=torch.uint8))  # another state


# The mistakes each launched plant is named as; a tuple where the drill's random steps decide
# which of two readings shows it first.
NAMED_AS = {"blank": None, "no_handler": "no handler", "saving_inside_the_handler": "saving inside the handler",
            "rank_0_alone_decides": "rank 0 alone decides", "each_rank_decides_alone": "each rank decides alone",
            "rng_state_not_saved": "random state not saved",
            "async_save_on_the_default_group": "async save on the default group",
            "data_position_not_saved": "data position not saved",
            "half_written_checkpoint_loaded": ("a half-written checkpoint loaded",
                                               "a half-written checkpoint loaded, and failed"),
            "async_future_never_awaited": ("a save never awaited, hung at exit",
                                           "a save never awaited, aborted at exit", "the last save lost"),
            "scheduler_not_restored": "learning rate not restored",
            "optimizer_not_restored": ("learning rate not restored", "weights or momentum not restored")}


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_planted_mistake_is_named(mistake, worker, no_orphans, reference):
    change, message = MISTAKES[mistake]
    source = conventions.blank_source(SAFE) if change is None else planted(SAFE, change)
    with names(NAMED_AS[mistake], says=re.compile(message, re.S)):
        drill(worker, source, reference)


# --- the drill's readings, made by hand: each mistake of its tables, whatever the timing ---

def _stopped(returncodes, reports, killed=False, last=None, ranks=(0, 1)):
    job = LaunchResult(nproc=2, returncodes=returncodes, reports=reports, exit_order=sorted(returncodes))
    return lambda: preemption._after_sigterm(job, last, killed, ranks, "first launch")


def _report(step, stopped=int(signal.SIGTERM)):
    return {"step": step, "stopped": stopped}


STEPPED = {0: _report(5), 1: _report(5)}
BY_HAND = {  # a mistake of the drill's tables -> the reading that shows it, what is said
    "a save never awaited, hung at exit": (_stopped({0: -9, 1: -9}, STEPPED, killed=True, last={0: (1, 5), 1: (2, 5)}),
                                           "hung at exit"),
    "a save never awaited, aborted at exit": (_stopped({0: 0, 1: -6}, STEPPED), "aborted as it exited"),
    "each rank decides alone": (_stopped({0: -9, 1: -9}, {}, killed=True, last={0: (1, 5), 1: (2, 6)}),
                                "stopped at different steps"),
    "the ranks stop apart": (_stopped({0: 0, 1: 0}, {0: _report(5), 1: _report(6)}),
                             r"reported \(steps done, signal\) = \{0: \(5, 15\), 1: \(6, 15\)\}"),
    "a half-written checkpoint loaded": (lambda: preemption._resumed(
        LaunchResult(nproc=2, reports={0: {"start": int(preemption.PLANTED.split("_")[1])}}), 5, "second launch"),
        "loaded step_999999"),
    "the last save lost": (lambda: preemption._resumed(LaunchResult(nproc=2, reports={0: {"start": 3}}), 5,
                                                       "second launch"), "the work of steps 4..5 was lost"),
    "a half-written checkpoint loaded, and failed": (
        lambda: name_the_first((preemption.HALF_WRITTEN_TRIED,), f"loading {preemption.PLANTED}", "ValueError: short"),
        "tried to load step_999999"),
    "weights or momentum not restored": (
        lambda: preemption._compare({0: {"trained": {4: {"samples": [1], "noise": 0.5, "lr": 0.1, "loss": 2.0}}}},
                                    [{0: {"start": 3, "trained": {4: {"samples": [1], "noise": 0.5, "lr": 0.1,
                                                                      "loss": 2.5}}}}], None),
        "computed another loss"),
}


@pytest.mark.parametrize("name", BY_HAND)
def test_a_reading_of_the_drill_is_named(name):
    judge, says = BY_HAND[name]
    with names(name, says=says):
        judge()


@pytest.mark.processes
def test_the_plain_script_itself_fails(worker, no_orphans, reference):
    """The trivial answer, the given script unchanged, meets the first SIGTERM unprepared."""
    with pytest.raises(CheckFailed, match=r"nothing caught the signal"):
        drill(worker, CELLS[f"{STEM}/plain_train.py"], reference)


def test_a_reference_of_another_length_is_refused(tmp_path):
    short = {0: {"trained": {1: {}, 2: {}}}}
    with pytest.raises(CheckFailed, match=r"the reference trained 2 steps, the drill runs 30"):
        check_preemption_safe(tmp_path / "safe_train.py", short, steps=STEPS)


PLANTS = {**GPU_READINGS, **BY_HAND,
          "periodic saves block the training": "test_periodic_saves_that_block_the_training_are_named",
          **{name: plant for plant, name in NAMED_AS.items() if isinstance(name, str)}}
