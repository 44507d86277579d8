"""The Makefile's choice to keep or replace .venv (issue 25: a .venv of another Python was
reused and the install failed again). `make quick` runs for real against stand-in
interpreters that log what they are asked to do instead of installing anything."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.processes  # make and the stand-in interpreters


def fake_python(path: Path, version: str | None) -> Path:
    """A stand-in interpreter: prints ``version`` for the Makefile's `-c` question, logs every
    `-m` command to log.txt beside the Makefile, and `-m venv DIR` copies itself to
    DIR/bin/python. ``version`` None: an interpreter that no longer runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = ('case "$1" in\n'
            f'  -c) echo {version} ;;\n'
            '  -m) echo "$*" >> log.txt\n'
            '      if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi ;;\n'
            'esac\n') if version else "exit 127\n"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def course(tmp_path):
    """A copy of the Makefile and pyproject.toml beside a finished install made by Python 3.12."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    fake_python(tmp_path / ".venv" / "bin" / "python", "3.12")
    (tmp_path / ".venv" / "bin" / "spike-course").write_text("")
    os.utime(tmp_path / "pyproject.toml", (1, 1))  # older than the install
    return tmp_path


def make_quick(course, *args, python_from_environment=None) -> tuple[str, list[str]]:
    """(what make printed, the interpreters' logged commands)."""
    env = {**os.environ, "PYTHON": str(python_from_environment)} if python_from_environment else None
    done = subprocess.run(["make", "quick", *args], cwd=course, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    log = course / "log.txt"
    return done.stdout, log.read_text().splitlines() if log.exists() else []


def test_a_working_venv_is_kept(course):
    for args in [(), (f"PYTHON={fake_python(course / 'py312', '3.12')}",)]:
        printed, commands = make_quick(course, *args)
        assert [c.split()[:2] for c in commands] == [["-m", "pytest"]], printed  # no install
        (course / "log.txt").unlink()


def test_a_venv_that_no_longer_runs_is_made_again(course):
    fake_python(course / ".venv" / "bin" / "python", None)
    printed, commands = make_quick(course, python_from_environment=fake_python(course / "py311", "3.11"))
    assert ".venv does not run" in printed
    assert commands[0] == "-m venv .venv" and "-m pip install -e .[test]" in commands, commands


def test_python_named_on_the_command_line_replaces_a_venv_of_another_version(course):
    printed, commands = make_quick(course, f"PYTHON={fake_python(course / 'py313', '3.13')}")
    assert ".venv was made by Python 3.12" in printed and "is 3.13: removing .venv" in printed
    assert commands[0] == "-m venv .venv" and "-m pip install -e .[test]" in commands, commands


def test_a_python_that_does_not_run_gets_the_installed_ones_listed(tmp_path):
    """`make lab PYTHON=python3.12` where no python3.12 runs (pyenv's shim without that version
    active, say) lists the Pythons that do run, from PATH and pyenv's versions, and names the
    one asked for by its full path: not the command just typed."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    on_path = fake_python(tmp_path / "bin" / "python3.11", "3.11")
    shim = tmp_path / "shims" / "python3.12"  # answers only for a version pyenv made active
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    in_pyenv = fake_python(tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3", "3.12")
    too_old = fake_python(tmp_path / "pyenv" / "versions" / "3.9.18" / "bin" / "python3", "3.9")
    env = {**os.environ, "PATH": f"{shim.parent}:{on_path.parent}:{os.environ['PATH']}",
           "PYENV_ROOT": str(tmp_path / "pyenv")}
    done = subprocess.run(["make", "lab", "PYTHON=python3.12"], cwd=tmp_path, capture_output=True, text=True,
                          env=env)
    assert done.returncode != 0
    said = done.stdout
    assert "no python3.12 runs here" in said, said
    assert f"  {on_path}  (Python 3.11)" in said and f"  {in_pyenv}  (Python 3.12)" in said, said
    assert f"  {too_old}  (Python 3.9, not supported)" in said and str(shim) not in said, said
    assert f"name one by its full path: make lab PYTHON={in_pyenv}" in said, said
    assert not (tmp_path / "log.txt").exists()  # nothing was installed
