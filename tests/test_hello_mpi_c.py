"""The corrected MPI program of chapter 01 compiles (and runs, where an MPI is installed)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from spike_course.course import conventions

import course_files

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_message_passing.ipynb"

# Just enough of mpi.h to let a C compiler check that the program declares what it uses.
STUB_MPI_H = """
typedef int MPI_Comm; typedef int MPI_Datatype; typedef int MPI_Request; typedef int MPI_Status;
#define MPI_COMM_WORLD 0
#define MPI_INT 1
#define MPI_STATUS_IGNORE ((MPI_Status *) 0)
int MPI_Init(int *argc, char ***argv);
int MPI_Finalize(void);
int MPI_Comm_rank(MPI_Comm comm, int *rank);
int MPI_Comm_size(MPI_Comm comm, int *size);
int MPI_Isend(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm,
              MPI_Request *request);
int MPI_Irecv(void *buf, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm,
              MPI_Request *request);
int MPI_Wait(MPI_Request *request, MPI_Status *status);
"""


@pytest.fixture
def c_source(tmp_path):
    written = conventions.written_files(course_files.notebook(NOTEBOOK))
    path = tmp_path / "hello_mpi.c"
    path.write_text(next(text for name, text in written.items() if name.endswith(".c")) + "\n")
    return path


def test_every_rank_that_waits_posted_its_request(c_source):
    text = c_source.read_text()
    # each MPI_Wait sits in the same branch as the Isend/Irecv that filled the request
    branches = re.split(r"\} else if|\bif \(", text)
    for branch in branches:
        if "MPI_Wait" in branch:
            assert "MPI_Isend" in branch or "MPI_Irecv" in branch, branch


@pytest.mark.processes
@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_declares_everything_it_uses(c_source, tmp_path):
    (tmp_path / "mpi.h").write_text(STUB_MPI_H)
    run = subprocess.run(["gcc", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", str(tmp_path),
                          str(c_source)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _an_mpi_or_skip():
    """Skip where no MPI is installed (a learner's laptop), but fail under CI (CI=true), whose
    .ci/run installs Open MPI: a test that always skipped there would never run."""
    if shutil.which("mpicc") and shutil.which("mpirun"):
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but no mpicc and mpirun: .ci/run installs them (apt-get install openmpi-bin libopenmpi-dev)")
    pytest.skip("needs an MPI: apt-get install openmpi-bin libopenmpi-dev (CI does)")


@pytest.mark.processes
def test_runs_on_two_ranks(c_source, tmp_path):
    _an_mpi_or_skip()
    binary = tmp_path / "hello_mpi"
    subprocess.run(["mpicc", "-Wall", "-o", str(binary), str(c_source)], check=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    flags = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    run = subprocess.run(["mpirun", *flags, "-np", "2", str(binary)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0 and "rank 1 received 42 from rank 0" in run.stdout, run.stdout + run.stderr


def test_ci_without_an_mpi_fails_where_a_laptop_skips(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="openmpi-bin"):
        _an_mpi_or_skip()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="needs an MPI"):
        _an_mpi_or_skip()
