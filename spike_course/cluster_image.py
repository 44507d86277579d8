"""A Python that lacks what a cluster image lacks.

A worker script must run where only the standard library and torch are installed. The
cluster-worker tests and the capstone check prove it by starting every Python with a
``sitecustomize`` that refuses the notebook side.

Every notebook imports the checks, and the capstone check imports this module: keep it
to the standard library. (``nbformat``, for one, takes about 2 s to import here: its
schema validator loads format checkers that compile a grammar at import.)
"""


def import_blocker(blocked, why: str) -> str:
    """Source of a ``sitecustomize.py`` that makes the ``blocked`` modules (and their
    submodules) unimportable, with ``why`` in the error: put its folder on PYTHONPATH and
    every Python started there (torchrun's ranks too) behaves like a cluster image that
    lacks them. The tests and the capstone check prove with it that a worker needs
    nothing of the notebook side."""
    return f'''
import importlib.abc
import sys

BLOCKED = {tuple(blocked)!r}
WHY = {why!r}


class NotOnTheCluster(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"{{name}} {{WHY}}", name=name)
        return None


sys.meta_path.insert(0, NotOnTheCluster())
'''
