"""Start a job's pods on this machine: each one a process group, as its container would run it.

A pod runs its command (``bash -lc '...'`` for a Run:ai line) in a clean environment: the
variables the operator injects, a container's PATH, no GPU (so ranks pick gloo), and a home
whose login profile puts the tools of the rehearsal first (a login shell's /etc/profile
resets PATH, as it does in the cluster's images). Two kinds of tools:

* ``dry``: ``torchrun``, ``python`` and ``python3`` only write down how they were called
  (arguments, environment, process id) and exit: what every pod would launch, in a second;
* ``real``: the course's own Python and torchrun, with ``pod_site`` on PYTHONPATH, whose
  ``sitecustomize`` records what every process saw and wrote.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

POD_SITE = Path(__file__).with_name("pod_site")
# The course's workers import spike_course's runtime; the README's image recipe installs the
# package in the cluster's image, so the pods find it here too.
COURSE_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("torchrun", "python", "python3")

# Run by the dry tools with `python -I` (no site, no PYTHONPATH): one JSON line, then exit 0.
_DRY_TOOL = """\
import json, os, sys
record = dict(tool=sys.argv[1], argv=sys.argv[2:], env=dict(os.environ), pid=os.getpid(),
              ppid=os.getppid(), cwd=os.getcwd(), pod=os.environ.get("SPIKE_REHEARSAL_POD"))
with open(os.path.join(os.environ["SPIKE_REHEARSAL_RECORDS"], "launches.jsonl"), "a") as out:
    out.write(json.dumps(record) + "\\n")
"""


def make_tools(folder: Path, dry: bool) -> Path:
    """A bin folder with torchrun, python and python3 (each ``exec``s, so its pid is the
    caller's); returns the folder of the pods' homes (see :func:`home_of`)."""
    tools = folder / "bin"
    tools.mkdir(parents=True, exist_ok=True)
    if dry:
        (folder / "dry_tool.py").write_text(_DRY_TOOL)
    environment_bin = Path(sys.executable).parent
    for tool in TOOLS:
        if dry:
            line = f'exec {shlex.quote(sys.executable)} -I {shlex.quote(str(folder / "dry_tool.py"))} {tool} "$@"'
        else:
            target = environment_bin / tool if (environment_bin / tool).exists() else Path(sys.executable)
            line = f'exec {shlex.quote(str(target))} "$@"'
        (tools / tool).write_text(f"#!/bin/sh\n{line}\n")
        (tools / tool).chmod(0o755)
    return folder


def home_of(tools_folder: Path, pod: str) -> Path:
    """A pod's own home (as each container has its own), whose .bash_profile puts the tools
    first on PATH."""
    home = tools_folder / "homes" / pod
    home.mkdir(parents=True, exist_ok=True)
    (home / ".bash_profile").write_text(f'export PATH={shlex.quote(str(tools_folder / "bin"))}:"$PATH"\n')
    return home


def pod_environment(injected: dict, *, home: Path, records: Path, pod: str, gpus: float) -> dict:
    """What a process in the pod's container starts with: a container's PATH, the operator's
    variables, no GPU, and the rehearsal's records folder."""
    inherited = {k: os.environ[k] for k in ("LANG", "LC_ALL", "TMPDIR", "SPIKE_COURSE_DATA")
                 if k in os.environ}
    return {**inherited, "PATH": CONTAINER_PATH, "HOME": str(home), "USER": "pod",
            "PYTHONPATH": f"{POD_SITE}:{COURSE_PACKAGE_PARENT}", "CUDA_VISIBLE_DEVICES": "",
            "SPIKE_REHEARSAL_RECORDS": str(records), "SPIKE_REHEARSAL_POD": pod,
            "SPIKE_REHEARSAL_GPUS": str(gpus), **injected}


def on_this_machine(text: str, mount: str | None, volume: Path | None) -> str:
    """``text`` with the cluster path of the volume (``/data``) replaced by its copy here."""
    if not mount or volume is None:
        return text
    return re.sub(rf"(?<![\w./-]){re.escape(mount.rstrip('/'))}(?![\w.-])", str(volume), text)


def start(command: list[str], environment: dict, cwd: Path, output) -> subprocess.Popen:
    """The pod's main process, in a session of its own (so that the whole pod can be killed)."""
    return subprocess.Popen(command, env=environment, cwd=cwd, stdout=output,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill_pod(process: subprocess.Popen) -> None:
    """SIGKILL to everything the pod started (its session), as the kubelet does at the end of
    the grace period."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_records(records: Path, name: str = "*.jsonl") -> list[dict]:
    """Every JSON line the pods' processes wrote, oldest first."""
    lines = []
    for path in sorted(records.glob(name)):
        for line in path.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a SIGKILL
                continue
    return sorted(lines, key=lambda r: r.get("t", 0))
