import contextlib
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch  # noqa: F401  imported here, not inside a test: its first import runs ldconfig

from spike_course.lab import warm

os.environ.setdefault("SPIKE_COURSE_DATA", "synthetic")

PROCESSES = "processes"  # the marker `make quick` leaves out
STARTED = pytest.StashKey[float]()
ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items):
    # Every notebook cell that nbval runs lives in a kernel, a process of its own.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(PROCESSES)


def pytest_sessionstart(session):
    session.config.stash[STARTED] = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    """With SPIKE_COURSE_RECORD_RUN_TIMES=1, a whole run (every test path, nothing deselected)
    that passed records its time in notebooks/run_times.json: the README states it."""
    from spike_course.course import run_times

    config = session.config
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
             and not config.option.markexpr)
    if run_times.recording() and whole and exitstatus == 0 and not hasattr(config, "workerinput"):
        run_times.record(ROOT / run_times.FILE, builds={"pytest": time.monotonic() - config.stash[STARTED]},
                         workers=config.getoption("numprocesses", None) or 1)


def pytest_terminal_summary(terminalreporter):
    """Say which notebooks the tests did not read as they are on disk: the tests read what git
    stages (course_files), nbval runs the working tree. For a learner that is their own work;
    for a maintainer, an edit that needs `git add` before the tests see it."""
    import course_files

    changed, untracked = course_files.differing()
    if changed or untracked:
        terminalreporter.section("notebooks read as git stages them")
        for what, paths in (("cells differ from git's index", changed), ("not in git", untracked)):
            if paths:
                terminalreporter.write_line(f"{what}: {', '.join(paths)}")
        terminalreporter.write_line("The tests read these as git stages them, your work aside (nbval runs the "
                                    "lectures and solutions as they are on disk). A maintainer's edit needs "
                                    "`git add` before every test reads it.")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _processes_refused_unless_marked(item):
        return (yield)  # fixtures too: a module-scoped one may launch the ranks its tests read


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _processes_refused_unless_marked(item):
        return (yield)


@contextlib.contextmanager
def _processes_refused_unless_marked(item):
    """A test that starts a process (a rank, a kernel, torchrun, a compiler) must say so with
    @pytest.mark.processes, so that `make quick` can leave it out and stay quick."""
    if item.get_closest_marker(PROCESSES):
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{item.nodeid} starts a process: mark it @pytest.mark.{PROCESSES}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(warm.WarmJob, "start", refuse)  # a warm server forks ranks for the test
        yield


@pytest.fixture
def no_orphans():
    """Fail a test that leaves any child process of this test process behind. The warm start
    server lives as long as the test process, by design; its ranks must not."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    servers = set(warm.server_pids())
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before | servers]
    gone, alive = psutil.wait_procs(left, timeout=2)
    assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"


@pytest.fixture
def worker(tmp_path):
    """Write a worker script into a temporary folder and return its path."""
    def write(source: str, name: str = "worker.py"):
        path = tmp_path / name
        path.write_text(source)
        return path
    return write
