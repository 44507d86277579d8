"""spike_course: the support package of a hands-on course on distributed PyTorch.

Notebooks and worker scripts use it by namespace, e.g. ``spike_course.launch(...)``
and ``from spike_course import runtime``. Importing the package does not import torch:
the launcher must stay fast; the modules that need torch import it themselves.
"""

from . import notebook, runtime
from .launch import LaunchError, LaunchResult, launch

__all__ = ["launch", "LaunchError", "LaunchResult", "notebook", "runtime"]
__version__ = "0.1.0"
