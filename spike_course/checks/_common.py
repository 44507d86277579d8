"""Shared pieces of the checks package."""

from __future__ import annotations


class CheckFailed(AssertionError):
    """The exercise's answer is not right yet; the message says what is likely wrong."""


def passed(what: str) -> None:
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
