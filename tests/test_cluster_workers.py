"""Worker scripts are cluster programs: they run under bare torchrun, without the notebook side.

Each test exports the chapters' workers the way a learner does (``spike-course workers``)
and starts one under ``python -m torch.distributed.run --standalone --nproc-per-node=2``
in a Python where the launcher, psutil, ipywidgets and matplotlib cannot be imported: a
``sitecustomize`` refuses them, as a cluster image without them would.
"""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from spike_course import launch
from spike_course.course import workers
from spike_course.cluster_image import import_blocker
from spike_course.protocol import COLLECTIVE_TIMEOUT_ENV, PARENT_PID_ENV, RESULTS_DIR_ENV

import course_files

pytestmark = pytest.mark.processes  # most tests here start ranks, torchrun or kernels

ROOT = Path(__file__).resolve().parents[1]
# The notebook's process code, the course's tools and the checks are packages of their own.
NOTEBOOK_SIDE = ("spike_course.lab", "spike_course.course", "spike_course.checks", "spike_course.widgets",
                 "psutil", "ipywidgets", "matplotlib")
BLOCKER = import_blocker(NOTEBOOK_SIDE, "is notebook-side: a worker must not import it")

# One worker per chapter, with arguments that keep it to seconds on 2 cores.
WORKERS = {
    "03_data_parallel/train.py": ["--train-samples", "256", "--test-samples", "128", "--epochs", "1"],
    "04_pipeline_parallel/schedules.py": ["--width", "64", "--blocks", "2", "--microbatch-size", "8",
                                          "--microbatches", "2", "--interleaved"],
    "05_tensor_parallel/api_tp.py": ["--steps", "2"],
    "06_fully_sharded_data_parallel/fsdp2.py": ["--steps", "2", "--factors", "1", "2"],
    "07_launching_at_scale/train.py": ["--steps", "4", "--limit", "256", "--ckpt", "ckpt.pt"],
    "16_what_large_jobs_run_today/zero3.py": ["--width", "64", "--batch", "32", "--steps", "2"],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The exported workers and an environment like a cluster node's: no notebook side."""
    folder = tmp_path_factory.mktemp("cluster")
    workers.export(ROOT, folder / "workers")
    (folder / "site").mkdir()
    (folder / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items()
           if k not in (RESULTS_DIR_ENV, PARENT_PID_ENV, COLLECTIVE_TIMEOUT_ENV)}
    env.update(PYTHONPATH=str(folder / "site"), SPIKE_COURSE_DATA="synthetic", OMP_NUM_THREADS="1")
    return folder, env


def torchrun(folder, env, script, args=(), timeout=300):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(script), *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_worker_runs_under_bare_torchrun(cluster, name):
    folder, env = cluster
    done = torchrun(folder, env, folder / "workers" / name, WORKERS[name])
    assert done.returncode == 0, f"{name} failed under bare torchrun:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_blocker_catches_a_notebook_import(cluster):
    """Proof that the test above would fail: a worker that imports the launcher does."""
    folder, env = cluster
    script = folder / "imports_launcher.py"
    script.write_text("from spike_course import runtime\nfrom spike_course.lab.launcher import free_port\n")
    done = torchrun(folder, env, script, timeout=120)
    assert done.returncode != 0
    assert "spike_course.lab is notebook-side" in done.stdout + done.stderr


TIMEOUT_PROBE = """
import torch
import torch.distributed as dist
from spike_course import runtime


ctx = runtime.setup()
seconds = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
if ctx.is_main:
    print(f"collective timeout {seconds:g}", flush=True)
runtime.report(timeout=seconds)
runtime.teardown()
"""


def test_collective_timeout_is_pytorchs_under_torchrun_and_short_under_launch(cluster):
    import torch.distributed as dist

    folder, env = cluster
    script = folder / "timeout_probe.py"
    script.write_text(TIMEOUT_PROBE)
    done = torchrun(folder, env, script, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    default = dist.constants.default_pg_timeout  # gloo's: 30 minutes
    assert f"collective timeout {default.total_seconds():g}" in done.stdout, done.stdout

    launched = launch(script, nproc=2, echo=False)
    assert {r["timeout"] for r in launched.reports.values()} == {60.0}
    assert default > timedelta(seconds=60)


def test_spike_course_workers_writes_every_chapter_with_its_run_line(tmp_path):
    from spike_course.cli import main

    assert main(["workers", "--out", str(tmp_path)]) == 0
    chapters = {p.parent.name for p in tmp_path.glob("*/*.py")}
    lectures = {p.stem for p in course_files.tracked("notebooks", "[0-9][0-9]_*.ipynb")}
    # Every chapter writes Python workers (01 also a C program), except 13: its dry runs
    # happen in one process (the fake process group), before any job exists.
    assert chapters == lectures - {"13_sizing_a_job"}
    readme = (tmp_path / "README.md").read_text()
    for path in tmp_path.glob("*/*.py"):
        relative = f"{path.parent.name}/{path.name}"
        first = path.read_text().splitlines()[0]
        assert first.startswith(('"""torchrun --standalone --nproc-per-node=', '"""python ')), first
        script = next(word for word in first.split() if word.endswith(".py"))
        if workers.MODULE in first:  # a module: the script it names imports it, and is in the README
            importer = (tmp_path / script).read_text()
            assert f"import {path.stem}" in importer or f"from {path.stem} import" in importer, first
            assert first[3:] not in readme
        else:
            assert script == relative and first[3:] in readme, first
        compile(path.read_text(), str(path), "exec")  # a SyntaxError fails the test
    assert "### BEGIN SOLUTION" not in (tmp_path / "07_launching_at_scale" / "reshape.py").read_text()


def test_a_worker_without_its_run_line_is_refused_with_the_fix(tmp_path):
    import nbformat

    cell = '%%writefile workers/99_x/job.py\n"""Trains something."""\nimport torch.distributed\n'
    notebook = tmp_path / "99_x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), notebook)
    with pytest.raises(ValueError, match=r"workers/99_x/job.py: its docstring must start with the "
                                         r"line that runs it.*torchrun --standalone"):
        workers.export(ROOT, tmp_path / "out", [notebook])
    assert not (tmp_path / "out" / "99_x" / "job.py").exists()


def test_the_line_must_name_the_worker_itself():
    with pytest.raises(ValueError, match="must start with the line"):
        workers.run_line("03_x/train.py", '"""torchrun --standalone --nproc-per-node=2 03_x/other.py\n"""')
    assert workers.run_line("03_x/a.py", '"""python 03_x/a.py\n\nMore."""') == "python 03_x/a.py"
    module = "torchrun --standalone --nproc-per-node=2 03_x/train.py imports this module; not run on its own."
    assert workers.run_line("03_x/common.py", f'"""{module}\n"""') == module
    with pytest.raises(ValueError, match="must start with the line"):  # another folder's script
        workers.run_line("04_y/common.py", f'"""{module}\n"""')


def test_gpu_check_runs_on_and_names_every_failing_cell(tmp_path):
    import nbformat

    from spike_course.gpu_check import execute, table

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                               nbformat.v4.new_code_cell("assert x == 2, 'x is not 2'"),
                                               nbformat.v4.new_code_cell("y = 1 / 0"),
                                               nbformat.v4.new_code_cell("z = x + 1"),
                                               nbformat.v4.new_code_cell("assert z == 3, f'z is {z}'")])
    path = tmp_path / "broken.ipynb"
    nbformat.write(notebook, path)
    row = execute(path, timeout=60)
    assert not row["ok"] and row["failures"] == ["cell 1: AssertionError: x is not 2",
                                                 "cell 2: ZeroDivisionError: division by zero",
                                                 "cell 4: AssertionError: z is 2"]
    assert "FAIL cell 1: AssertionError: x is not 2; cell 2: ZeroDivisionError" in table([row], "a laptop")


def test_gpu_check_places_the_ranks_both_ways_from_two_gpus(monkeypatch):
    from spike_course.gpu_check import placement_env, placements

    assert placements("auto", 0) == placements("shared", 0) == ["cpu"]
    assert placements("auto", 1) == ["shared"]
    assert placements("auto", 2) == placements("auto", 8) == ["per-gpu", "shared"]
    assert placements("per-gpu", 8) == ["per-gpu"] and placements("shared", 8) == ["shared"]
    with pytest.raises(ValueError, match="per-gpu needs 2 GPUs or more"):
        placements("per-gpu", 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert placement_env("per-gpu") == {} and placement_env("shared") == {"CUDA_VISIBLE_DEVICES": "0"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # a node's share of GPUs: the first of them
    assert placement_env("shared") == {"CUDA_VISIBLE_DEVICES": "2"}


def test_gpu_check_on_two_gpus_runs_each_notebook_per_gpu_and_shared(tmp_path, monkeypatch, capsys):
    """On a node with 2 GPUs (pretended here) every notebook runs twice, and the shared run's
    kernel (so its ranks) sees one GPU only: the notebook's one cell says what it saw."""
    import nbformat

    from spike_course import gpu_check
    from spike_course.cli import main

    path = tmp_path / "03_visible.ipynb"
    cell = "import os\nassert False, os.environ.get('CUDA_VISIBLE_DEVICES', 'every GPU')"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 2)
    monkeypatch.setattr(gpu_check, "notebooks", lambda root, only: [path])
    assert main(["gpu-check", "--timeout", "60"]) == 1
    report = capsys.readouterr().out
    assert "| per-gpu | 0 |" in report and "FAIL cell 0: AssertionError: every GPU |" in report
    assert "| shared | 0 |" in report and "FAIL cell 0: AssertionError: 0 |" in report


def test_gpu_check_reports_what_the_ranks_used_and_that_a_cpu_run_is_no_evidence(tmp_path):
    import nbformat

    from spike_course.gpu_check import execute, table

    (tmp_path / "job.py").write_text(TIMEOUT_PROBE)
    cell = "from spike_course import launch\nassert launch('job.py', nproc=3, echo=False).ok"
    path = tmp_path / "03_probe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), path)
    row = execute(path, timeout=120)
    assert row["ok"], row["failure"]
    assert (row["ranks"], row["backend"], row["device"], row["gpu"]) == (3, "gloo", "cpu", "-")
    report = table([row], "a laptop")
    assert "| notebook | placement | ranks | backend | device | gpu | precision |" in report
    assert "NOT GPU EVIDENCE" in report
    gpu_row = dict(row, backend="nccl", device="cuda:0 (shared)", gpu="NVIDIA H200")
    assert "NOT GPU EVIDENCE" not in table([gpu_row], "a GPU node")


def test_a_helper_module_does_no_work_when_imported(cluster):
    """A module that workers import (its run line says so) parses no flags, joins no process
    group and needs no RANK: importing it with a stranger's flags and no launcher works."""
    folder, env = cluster
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    modules = [p for p in (folder / "workers").glob("*/*.py") if workers.MODULE in p.read_text().splitlines()[0]]
    assert len(modules) >= 5
    # One Python imports them all in turn, each from its own folder (a Python each would pay
    # torch's import a dozen times): the first that does work is named.
    probe = """
import importlib, sys
import torch.distributed as dist
sys.argv += ['--not-its-flag']
for folder, name in [%s]:
    sys.path.insert(0, folder)
    try:
        importlib.import_module(name)
        assert not dist.is_initialized(), 'it joined a process group'
    except BaseException as error:
        sys.exit(f'importing {folder}/{name}.py: {error!r}')
    sys.path.remove(folder)
    # it and the siblings it imported: another folder may reuse a name
    for loaded in [n for n, m in sys.modules.items() if (getattr(m, '__file__', None) or '').startswith(folder + '/')]:
        del sys.modules[loaded]
""" % ", ".join(repr((str(module.parent), module.stem)) for module in modules)
    done = subprocess.run([sys.executable, "-c", probe], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
