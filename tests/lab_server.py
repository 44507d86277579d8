"""JupyterLab started the way ``make lab`` does (``spike-course lab``), for the tests that
drive it: the browser test and the terminal test."""

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from spike_course.lab.launcher import free_port, stop_process_tree

import course_files

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "spike-course-test"


@contextlib.contextmanager
def running_lab(tmp_path, notebooks=(), env=None):
    """JupyterLab on a copy of the course (it saves what it runs) holding ``notebooks``;
    yields (url, token). Its output goes nowhere, as under a JupyterHub: no terminal."""
    course = tmp_path / "course"
    (course / "notebooks").mkdir(parents=True)
    for notebook in notebooks:  # as the course ships it, not as a learner saved it
        course_files.copy_to(notebook, course / notebook)
    shutil.copy(ROOT / "pyproject.toml", course / "pyproject.toml")
    # Its own runtime and workspace folders: no other lab's open tabs come back in this one.
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), **(env or {})}
    port = free_port()
    lab = subprocess.Popen([sys.executable, "-m", "spike_course.cli", "lab", "--port", str(port),
                            "--token", TOKEN, "--no-browser"], cwd=course, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or lab.poll() is not None:
                    raise RuntimeError("JupyterLab did not start within 90 s")
                time.sleep(0.5)
        yield url, TOKEN
    finally:
        stop_process_tree([lab])
