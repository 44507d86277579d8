import os

import psutil
import pytest

os.environ.setdefault("SPIKE_COURSE_DATA", "synthetic")


@pytest.fixture
def no_orphans():
    """Fail a test that leaves any child process of this test process behind."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
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
