"""`make lab` as a learner uses it: a terminal opened in JupyterLab finds the course's
torchrun, python and spike-course (chapters 00 and 17 send learners there)."""

import json
import sys
import time
from pathlib import Path

import pytest
from lab_server import running_lab

from spike_course.cli import lab_environment, terminal_shell

BIN = str(Path(sys.executable).parent)


def test_the_lab_puts_this_environment_first_on_path():
    env = lab_environment({"PATH": f"/usr/bin{':'}{BIN}{':'}/bin"})
    assert env["PATH"].split(":") == [BIN, "/usr/bin", "/bin"]


def test_bash_reads_the_learners_bashrc_and_then_puts_this_environment_first(tmp_path):
    shell, option, rc = terminal_shell("/bin/bash", tmp_path)
    assert (shell, option, Path(rc).parent) == ("/bin/bash", "--rcfile", tmp_path)
    assert Path(rc).read_text().splitlines() == ["[ -f ~/.bashrc ] && . ~/.bashrc", f'export PATH={BIN}:"$PATH"']
    assert terminal_shell("/usr/bin/zsh", tmp_path) == ["/usr/bin/zsh"]


@pytest.mark.processes
def test_a_terminal_in_jupyterlab_finds_the_courses_commands(tmp_path):
    """Through JupyterLab's own terminal API, as its Terminal tab does. JupyterLab runs with
    no terminal of its own here (as under a JupyterHub), so it would start a login shell."""
    import urllib.request

    from tornado.ioloop import IOLoop
    from tornado.websocket import websocket_connect

    with running_lab(tmp_path) as (url, token):
        request = urllib.request.Request(f"{url}/api/terminals?token={token}", method="POST")
        name = json.load(urllib.request.urlopen(request, timeout=30))["name"]

        async def ask(command):
            socket = await websocket_connect(f"ws{url[4:]}/terminals/websocket/{name}?token={token}")
            socket.write_message(json.dumps(["stdin", command + "\r"]))
            seen, deadline = "", time.monotonic() + 60
            while "END-OF-ANSWER" not in seen and time.monotonic() < deadline:  # not in the echoed command
                message = await socket.read_message()
                if message is None:
                    break
                kind, *payload = json.loads(message)
                if kind == "stdout":
                    seen += payload[0]
            socket.close()
            return seen

        seen = IOLoop.current().run_sync(
            lambda: ask('for c in torchrun python spike-course; do command -v "$c"; done; echo "END-OF-"ANSWER'),
            timeout=90)
    for command in ("torchrun", "python", "spike-course"):
        assert f"{BIN}/{command}" in seen, seen


def test_doctor_ends_with_a_verdict_and_says_when_a_shell_misses_torchrun(monkeypatch, capsys):
    from spike_course.cli import main

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a shell where the environment is not active
    assert main(["doctor"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[-2].startswith("ready: every chapter runs here")
    assert said[-1].startswith("note: this shell's torchrun is") and f"source {BIN}/activate" in said[-1]
    monkeypatch.setenv("PATH", f"{BIN}:/usr/bin")
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("ready:")
