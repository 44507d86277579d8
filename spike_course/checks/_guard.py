"""The checks guard themselves in the learner's own kernel.

Code in an answer runs in the same kernel before the check cell, so it could replace what
the check calls (``checks.check_x = lambda *a: None``, ``math.isclose = lambda *a: True``,
a cost-model function the check compares with). The course's first cell imports the
checks before any answer runs; at that moment :func:`take_snapshot` records every function,
class and table (tuple) of the course's modules, what the classes the checks judge with hold,
``math``'s functions, and the builtins and torch comparisons the checks rely on. Each check
verifies the record before it starts and before it prints "check passed", and fails with
``Tampering`` naming what was replaced. The ``checks`` package itself refuses new values
(:class:`SealedModule`), so the first attack fails where it is written. (``spike-course
grade`` refuses all of these before anything runs: ``spike_course.course.answer_scan``.)
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import math
import sys
import types

from ..mistakes import CheckFailed

_BUILTINS = ("abs", "all", "any", "float", "int", "isinstance", "len", "max", "min", "print", "range",
             "repr", "round", "sorted", "str", "sum", "zip")
_TORCH = ("allclose", "equal", "isclose", "is_tensor", "as_tensor", "tensor",
          # chapter 16's FP8 check casts, compares bits and multiplies as the answer's GEMM would
          "_scaled_mm", "frexp", "broadcast_shapes", "maximum", "float8_e4m3fn", "uint8", "Generator", "randn",
          # ...and 16.5's compiles the answer's forward with a backend that counts graphs
          "compile")
_TENSOR = ("allclose", "equal", "item", "tolist", "__eq__", "double", "float",
           "to", "view", "abs", "amax", "clone", "sum", "mean", "all", "__mul__", "__matmul__", "__ne__", "__gt__",
           "__lt__", "__le__")
# What a module holds that a check relies on: its functions and classes, and its tuples (the
# checks' tables of mistakes are tuples of Mistakes: rebinding one would empty a check).
_KINDS = (types.FunctionType, types.BuiltinFunctionType, type, tuple)
# The modules whose classes the checks judge with: the verdict's shape, the launch result they
# read, their own readings. (Not the launcher's machinery, which the tests patch to refuse a
# process where a test did not say it starts one.)
_JUDGING = ("spike_course.mistakes", "spike_course.lab.launcher", "spike_course.checks",
            "spike_course.models")  # 16.5's check compares with ClippedBlock's forward


class Tampering(CheckFailed):
    """Code in the notebook replaced something a check relies on."""


def _watched() -> dict:
    """(place, name) -> the object there now, for everything the checks rely on."""
    import torch

    course = {name: module for name, module in list(sys.modules.items())
              if module is not None and (name == "spike_course" or name.startswith("spike_course."))}
    places = {f"{name}.": vars(module) for name, module in course.items()}
    places["math."] = vars(math)
    found = {(place, name): value for place, space in places.items() for name, value in list(space.items())
             if isinstance(value, _KINDS)}
    # ...and all that the classes the checks judge with hold: a method or field replaced on a
    # class (say Mistake.seen, which every check's table calls) changes no module's names.
    found.update({(f"{name}.{key}.", attribute): value for name, module in course.items()
                  if name.startswith(_JUDGING)
                  for key, cls in list(vars(module).items()) if isinstance(cls, type) and cls.__module__ == name
                  for attribute, value in list(vars(cls).items())})
    found.update({("", name): getattr(builtins, name) for name in _BUILTINS})
    found.update({("torch.", name): getattr(torch, name) for name in _TORCH})
    found.update({("torch.Tensor.", name): getattr(torch.Tensor, name) for name in _TENSOR})
    return found


_snapshot: dict = {}


def take_snapshot() -> None:
    """Record what the checks rely on as it is now (called once, when the checks are imported)."""
    _snapshot.clear()
    _snapshot.update(_watched())


def replaced() -> list[str]:
    """What code has replaced since the snapshot, as ``place.name``."""
    now = _watched()
    return [place + name for (place, name), value in _snapshot.items() if now.get((place, name)) is not value]


def verify() -> None:
    """Fail with ``Tampering`` when anything the checks rely on was replaced."""
    gone = replaced()
    if gone:
        raise Tampering(
            f"Tampering: code in this notebook replaced {', '.join(gone[:5])}"
            f"{' and more' if len(gone) > 5 else ''}, which the checks rely on: a check cannot "
            "say anything true after that. Remove that code and restart the kernel (Kernel > "
            "Restart Kernel), then run the notebook from the top.")


def guarded(check):
    """``check``, verifying the snapshot before it starts."""
    @functools.wraps(check)
    def run_guarded(*args, **kwargs):
        verify()
        return check(*args, **kwargs)
    return run_guarded


_trusted = []  # non-empty inside trusting_a_spy()


@contextlib.contextmanager
def trusting_a_spy():
    """For a test that replaces a check's helper on purpose with a spy that calls it: the
    snapshot is taken with the spy in place and the spy's calls are not borrowing; the
    previous snapshot is back afterwards."""
    before = dict(_snapshot)
    take_snapshot()
    _trusted.append(True)
    try:
        yield
    finally:
        _trusted.pop()
        _snapshot.clear()
        _snapshot.update(before)


class SealedModule(types.ModuleType):
    """A module whose names cannot be given new values or deleted."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
            return super().__setattr__(name, value)  # the import system binding a submodule
        raise Tampering(f"Tampering: this notebook tried to replace {self.__name__}.{name}; the checks "
                        "are the course's and cannot be changed from a notebook. Remove that line, "
                        "restart the kernel and run the notebook from the top.")

    def __delattr__(self, name):
        self.__setattr__(name, None)


@contextlib.contextmanager
def borrowing_refused(what: str, forbidden=(), fix: str = "", answers=()):
    """While a check runs an answer: every call the answer's own code makes (code outside the
    course's package) to the checks' code or to one of ``forbidden`` is recorded by a profile
    hook, outside the answer's reach (a name split into pieces, an alias or getattr cannot
    hide a call), and fails the check as ``BorrowedAnswer``, whatever else it found; so does
    one of ``answers`` (the functions handed to the check) that is such code itself."""
    import os

    import spike_course

    package = os.path.dirname(spike_course.__file__) + os.sep
    checks_code = os.path.dirname(__file__) + os.sep
    codes = {function.__code__ for function in forbidden}
    borrowed = [code.co_qualname for code in (getattr(answer, "__code__", None) for answer in answers)
                if code is not None and (code in codes or code.co_filename.startswith(checks_code))]

    def record(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename != __file__ and (code in codes or code.co_filename.startswith(checks_code)):
            caller = frame.f_back
            if caller is not None and not caller.f_code.co_filename.startswith(package) and not _trusted:
                borrowed.append(code.co_qualname)

    previous = sys.getprofile()
    sys.setprofile(record)
    try:
        yield
    except Exception:
        if not borrowed:  # else a borrowed answer's failure, or crash, is named as borrowing
            raise
    finally:
        hook_kept = sys.getprofile() is record
        sys.setprofile(previous)
    if not hook_kept:
        raise Tampering(f"Tampering: {what} removed the profile hook the check records calls with "
                        "(sys.setprofile): the check cannot trust what it ran.")
    if borrowed:
        names = ", ".join(sorted(set(borrowed)))
        raise CheckFailed(f"BorrowedAnswer: {what} calls {names}, the course's own answer, which is "
                          f"what this check compares with. {fix}".rstrip())
