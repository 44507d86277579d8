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
