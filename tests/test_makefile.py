"""The Makefile's choice to keep or replace .venv (issue 25: a .venv of another Python was
reused and the install failed again). `make -n` prints what it would run, without running it."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "pip install -e"

pytestmark = pytest.mark.processes  # make and a stand-in Python


def fake_python(path: Path, version: str | None) -> Path:
    """A stand-in interpreter that prints its version, as the Makefile asks it to; None: broken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + (f"echo {version}\n" if version else "exit 127\n"))
    path.chmod(0o755)
    return path


@pytest.fixture
def course(tmp_path):
    """A copy of the Makefile and pyproject.toml beside a finished install made by Python 3.12."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    fake_python(tmp_path / ".venv" / "bin" / "python", "3.12")
    installed = tmp_path / ".venv" / "bin" / "spike-course"
    installed.write_text("")
    os.utime(tmp_path / "pyproject.toml", (1, 1))  # older than the install
    return tmp_path


def dry_run(course, *args) -> str:
    done = subprocess.run(["make", "-n", "quick", *args], cwd=course, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_working_venv_is_kept(course):
    assert INSTALL not in dry_run(course)
    assert INSTALL not in dry_run(course, f"PYTHON={fake_python(course / 'py312', '3.12')}")


def test_a_venv_that_no_longer_runs_is_made_again(course):
    fake_python(course / ".venv" / "bin" / "python", None)
    out = dry_run(course)
    assert INSTALL in out and "does not run" in out


def test_python_named_on_the_command_line_replaces_a_venv_of_another_version(course):
    out = dry_run(course, f"PYTHON={fake_python(course / 'py313', '3.13')}")
    assert INSTALL in out and "removing .venv and making it again" in out
