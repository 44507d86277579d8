"""spike_course: the support package of a hands-on course on distributed PyTorch.

Notebooks and worker scripts use it by namespace, e.g. ``spike_course.launch(...)``
and ``from spike_course import runtime``. Importing the package imports nothing else:
a worker on a cluster (``from spike_course import runtime``) must not pull in the
notebook side (the launcher and psutil, the progress widgets), and the launcher must not
pay for torch. The names below are loaded the first time they are used.
"""

import importlib

__all__ = ["launch", "LaunchError", "LaunchResult", "notebook", "runtime"]
__version__ = "0.1.0"

_FROM_LAUNCH = ("launch", "LaunchError", "LaunchResult")


def __getattr__(name):
    # PEP 562: ``spike_course.launch`` works without importing the launcher up front.
    if name in _FROM_LAUNCH:
        return getattr(importlib.import_module(".lab.launcher", __name__), name)
    if name in ("notebook", "runtime"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'spike_course' has no attribute {name!r}")
