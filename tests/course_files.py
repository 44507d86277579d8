"""The course's notebooks as git holds them, for the tests that read what the course ships.

A learner works in the course folder itself: JupyterLab saves outputs (and its own metadata)
into every notebook it opens, and the exercises fill with answers. A test that read the
working tree would fail on that work (and tell the learner to strip outputs, wiping it). So
the tests read each notebook as it is in git's index: what was committed, or staged since
with ``git add``, which is how a maintainer has an edit tested. Outside a git checkout (a
downloaded archive) they read the working tree, there being nothing else.

Everything is read once, when a test module imports this one (during collection): two git
commands in all, and no process started inside a test (``make quick`` refuses those).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "solutions", "exercises")


def _git(*args, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, check=True).stdout


def _staged() -> dict[str, str] | None:
    """{path relative to ROOT: text} of every notebook in FOLDERS as the index holds it, or
    None when ROOT is not the top of a git checkout."""
    try:
        if Path(_git("rev-parse", "--show-toplevel").decode().strip()).resolve() != ROOT:
            return None  # the course unpacked inside some other repository: not its git
        listing = _git("ls-files", "--stage", "-z", "--", *(f"{f}/*.ipynb" for f in FOLDERS))
    except (OSError, subprocess.CalledProcessError):
        return None
    entries = []  # (object id, path); "mode id stage\tpath", stage 0 unless a merge is under way
    for entry in filter(None, listing.split(b"\0")):
        info, path = entry.split(b"\t", 1)
        _, object_id, stage = info.split()
        if stage == b"0":
            entries.append((object_id, path.decode()))
    blobs = _git("cat-file", "--batch", stdin=b"".join(oid + b"\n" for oid, _ in entries))
    texts, at = {}, 0
    for _, path in entries:  # each answer: "<id> blob <size>\n", the bytes, "\n"
        header_end = blobs.index(b"\n", at)
        size = int(blobs[at:header_end].split()[2])
        texts[path] = blobs[header_end + 1:header_end + 1 + size].decode()
        at = header_end + 1 + size + 1
    return texts


_STAGED = _staged()


def in_git() -> bool:
    """True when the tests read the index (a git checkout), False when the working tree."""
    return _STAGED is not None


def tracked(folder: str, pattern: str = "*.ipynb") -> list[Path]:
    """The course's notebooks in ``folder`` matching ``pattern``, sorted: those git tracks (a
    learner's own notebook there is not the course's), else those on disk."""
    if _STAGED is None:
        return sorted((ROOT / folder).glob(pattern))
    return sorted(ROOT / path for path in _STAGED
                  if Path(path).parent.name == folder and Path(path).match(pattern))


def text(path) -> str:
    """The text of the course's notebook at ``path`` (absolute, or relative to ROOT)."""
    relative = (ROOT / path).relative_to(ROOT).as_posix()
    if _STAGED is None:
        return (ROOT / relative).read_text()
    if relative not in _STAGED:
        raise FileNotFoundError(f"{relative} is not in git's index: `git add` it to have it tested")
    return _STAGED[relative]


def notebook(path) -> nbformat.NotebookNode:
    """The course's notebook at ``path``, as nbformat reads it."""
    return nbformat.reads(text(path), as_version=4)


def copy_to(path, target: Path) -> Path:
    """Write the course's notebook at ``path`` to ``target`` (a file, or a folder to put it in)."""
    target = Path(target)
    if target.is_dir():
        target = target / Path(path).name
    target.write_text(text(path))
    return target


def copy_course(target: Path) -> None:
    """Copy the course as the tests see it into ``target``: its notebooks as git's index holds
    them, every other file git lists (tracked, or new and not ignored) as it is on disk."""
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z").decode().split("\0")
    for path in filter(None, listed):
        source, copy = ROOT / path, Path(target) / path
        if path in (_STAGED or {}):
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(_STAGED[path])
        elif source.is_file() and not source.is_symlink():  # not the .venv link, nor a deleted file
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(source.read_bytes())
            copy.chmod(source.stat().st_mode)


def _sources(notebook_text: str) -> list[tuple[str, str]]:
    cells = json.loads(notebook_text).get("cells", [])
    return [(c.get("cell_type"), "".join(c.get("source", ""))) for c in cells]


def differing() -> tuple[list[str], list[str]]:
    """(tracked notebooks whose cells on disk differ from the index's, outputs aside; notebooks
    on disk that git does not track): what the tests did not read. Empty outside git."""
    if _STAGED is None:
        return [], []
    changed = []
    for path, staged in sorted(_STAGED.items()):
        try:
            if _sources((ROOT / path).read_text()) != _sources(staged):
                changed.append(path)
        except (OSError, ValueError):  # deleted, or half-saved: not what the tests read either
            changed.append(path)
    untracked = sorted(p.relative_to(ROOT).as_posix() for folder in FOLDERS
                       for p in (ROOT / folder).glob("*.ipynb") if p.relative_to(ROOT).as_posix() not in _STAGED)
    return changed, untracked
