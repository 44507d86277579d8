"""Shared pieces of the checks package."""

from __future__ import annotations

# The shape of a verdict, used by every check module through here.
from ..mistakes import CheckFailed, Mistake, name_the_first, tables  # noqa: F401


def passed(what: str) -> None:
    from ._guard import verify

    verify()  # nothing the check relied on was replaced while it ran
    print(f"check passed: {what}")


def close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """True when two tensors (or arrays, or numbers) agree within tolerance."""
    import torch

    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=rtol, atol=atol)


def all_close(actual: dict, expected: dict, factor: float = 1.0, rtol: float = 1e-5,
              atol: float = 1e-6) -> bool:
    """True when every tensor of ``expected`` (a dict by name), times ``factor``, agrees
    with the tensor of the same name in ``actual``."""
    import torch

    return all(close(actual[k], factor * torch.as_tensor(expected[k], dtype=torch.float64), rtol, atol)
               for k in expected)


def largest_difference(a: dict, b: dict) -> tuple[float, str]:
    """Largest absolute difference between two dicts of tensors (by name), and the name where it is."""
    import torch

    worst, where = 0.0, ""
    for name, value in a.items():
        value, other = (torch.as_tensor(t, dtype=torch.float64) for t in (value, b[name]))
        diff = (value - other).abs().max().item()
        if diff > worst:
            worst, where = diff, name
    return worst, where


def name_a_stopped_launch(job, what: str) -> None:
    """Fail, saying why, where a launch made with ``check=False`` did not end well: ``what`` not
    written yet (a rank stopped at its ``raise NotImplementedError``), a timeout, or a rank that
    failed; return where every rank ended well."""
    _name_blank_or_timeout(job, what)
    if not job.ok:
        raise CheckFailed(f"rank {job.failure.rank} failed (exit code {job.failure.code}): {job.failure.error}. "
                          "Run the script with spike_course.launch to see its traceback.")


def _name_blank_or_timeout(job, what: str) -> None:
    if job.failure is not None and job.failure.blank:
        raise CheckFailed(f"{what} is not written yet: a rank stopped at `raise NotImplementedError`. "
                          "Replace that line with your code and run it again.")
    if job.timed_out:
        raise CheckFailed(f"the workers timed out after {job.seconds:.0f} s: a rank waited in a collective or a "
                          "transfer that another rank never entered (every rank must make the same collective "
                          "calls, and each send needs its receive).")


def launch_reports(job, what: str) -> dict:
    """The ranks' reports of a launch made with ``check=False`` (so that a blank or broken
    exercise reaches its check), once what leaves nothing to compare has been named: ``what``
    not written yet (a rank stopped at its ``raise NotImplementedError``), a timeout, or a
    rank that failed before it reported. A plain {rank: report} dict passes through."""
    if not hasattr(job, "reports"):
        return job
    _name_blank_or_timeout(job, what)
    failure = job.failure
    missing = [r for r in range(job.nproc) if r not in job.reports]
    if missing:
        if failure is None or failure.code in (0, None):
            raise CheckFailed(f"ranks {missing} reported nothing: every rank must run the whole worker.")
        raise CheckFailed(f"rank {failure.rank} failed (exit code {failure.code}) before it reported: "
                          f"{failure.error}. The launch cell above shows its traceback; fix that error first.")
    return job.reports
