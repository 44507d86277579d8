"""The run times the course states, measured by its builds, with the machine that measured them.

``notebooks/run_times.json`` (committed) holds how long each lecture took to execute (kernel
start included), how long the builds took (``make html``, pytest), and for each figure the
machine (cores, CPU model) and the day. It is written only when asked
(``SPIKE_COURSE_RECORD_RUN_TIMES=1``, which ``make run-times`` sets), so that a learner's
``make html`` or ``make test`` leaves the course's files alone:

- ``spike-course html`` records every lecture it executed (a lecture that came from the cache
  keeps the figure of the run that filled it) and, when it executed them all, its own time;
- ``tests/conftest.py`` records pytest's time when a whole run passed.

``spike-course run-times`` then writes the README's figures, each between
``<!-- run-times: KEY -->`` and ``<!-- /run-times -->``, from the file; tests/test_run_times.py
fails when the README and the file disagree.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
from pathlib import Path

FILE = Path("notebooks") / "run_times.json"
RECORD_ENV = "SPIKE_COURSE_RECORD_RUN_TIMES"
BUILDS = ("make html", "pytest")  # what the README states a time for, measured or not yet
FIGURE = re.compile(r"<!-- run-times: (?P<key>[^>]*?) -->(?P<text>.*?)<!-- /run-times -->", re.S)


def recording() -> bool:
    return os.environ.get(RECORD_ENV, "") not in ("", "0")


def machine() -> str:
    """This machine in words: the cores this process may use and the CPU's model."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.machine()  # where there is no /proc/cpuinfo (macOS): arm64, x86_64
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cores} cores of {model}" if cores != 1 else f"1 core of {model}"


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {"lectures": {}, "builds": {}}


def record(path: Path, lectures: dict | None = None, builds: dict | None = None, **about) -> dict:
    """Add ``lectures`` ({stem: seconds}) and ``builds`` ({name: seconds}) to the file at
    ``path``, each stamped with this machine and today; ``about`` goes with each build
    (tests=931, workers=2). Returns the file's new content."""
    data = load(path)
    stamp = {"machine": machine(), "day": datetime.date.today().isoformat()}
    for stem, seconds in (lectures or {}).items():
        data["lectures"][stem] = {"seconds": round(seconds, 1), **stamp}
    for name, seconds in (builds or {}).items():
        data["builds"][name] = {"seconds": round(seconds), **stamp, **about}
    data["lectures"] = dict(sorted(data["lectures"].items()))
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


def duration(seconds: float) -> str:
    """34 s, or 9.5 minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"


def figures(data: dict) -> dict[str, str]:
    """{README key: its text} from the file's content."""
    lectures, builds = data["lectures"], data["builds"]
    texts = {stem: duration(entry["seconds"]) for stem, entry in lectures.items()}
    if lectures:
        times = sorted(entry["seconds"] for entry in lectures.values())
        texts["lecture range"] = f"{duration(times[0])} to {duration(times[-1])}"
        texts["lectures measured"] = _where(lectures.values())
    for name in BUILDS:
        texts[name] = "not measured yet"
    for name, entry in builds.items():
        texts[name] = f"{duration(entry['seconds'])} ({_where([entry])})"
    return texts


def _where(entries) -> str:
    """'2 cores of AMD EPYC, 2026-12-06', or each machine with its days when they differ."""
    days = {}
    for entry in entries:
        days.setdefault(entry["machine"], set()).add(entry["day"])
    return "; ".join(f"{where}, {', '.join(sorted(on))}" for where, on in days.items())


def rewrite(text: str, data: dict) -> tuple[str, list[str]]:
    """``text`` (the README) with every figure between markers taken from ``data``, and the
    keys it marks that ``data`` has no figure for (those are left as they are)."""
    texts, unknown = figures(data), []

    def fill(match):
        key = match.group("key")
        if key not in texts:
            unknown.append(key)
            return match.group(0)
        return f"<!-- run-times: {key} -->{texts[key]}<!-- /run-times -->"

    return FIGURE.sub(fill, text), unknown


def disagreements(text: str, data: dict) -> list[str]:
    """Where the README's marked figures are not what ``data`` says: 'KEY: README says X,
    the measurement Y', or 'KEY: measured by nothing yet'."""
    texts, found = figures(data), []
    for match in FIGURE.finditer(text):
        key, said = match.group("key"), match.group("text")
        if key not in texts:
            found.append(f"{key}: measured by nothing yet")
        elif said != texts[key]:
            found.append(f"{key}: README says {said!r}, the measurement {texts[key]!r}")
    return found
