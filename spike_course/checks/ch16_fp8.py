"""Exercise check for chapter 16.2: the operands of an FP8 matrix multiplication, scaled.

``check_fp8_operands`` draws its own operands (its own generator and seed): ``x``, tokens by
features, with outlier tokens, and ``w``, features by outputs (``torch._scaled_mm``'s layout),
with outlier output channels, as large models have. The answer gets copies; the check judges
what comes back against the originals: the eight-bit format, the scales' shapes (can the
product divide them out?) and values (powers of two, the largest that clamps nothing), every
eight-bit value against the check's own cast of operand times scale, the share of values below
e4m3's normal range, and the product, which the check computes itself with ``torch._scaled_mm``.
"""

from __future__ import annotations

from typing import NamedTuple

from ._common import CheckFailed, Mistake, name_the_first, passed


class Draw(NamedTuple):
    """The check's operands and its limit, in a tuple: the guard (``_guard``) watches it, so an
    answer that rebinds it (to draw no outliers, or to allow more values lost) is named."""
    tokens: int = 64
    features: int = 128
    outputs: int = 96
    outlier_tokens: tuple = (5, 40)
    outlier_outputs: tuple = (7, 61)
    outlier_size: float = 300.0
    low_share: float = 0.01  # at most this share of an operand's values may fall below e4m3's normal range


DRAW = Draw()


class Operand:
    """One operand as the answer returned it: the original, the eight-bit tensor, the scale, and
    ``summed``, the dimension the product sums over (1 for x, 0 for w)."""

    def __init__(self, name, original, eight_bit, scale, summed):
        import torch

        self.name, self.original, self.eight_bit, self.scale, self.summed = name, original, eight_bit, scale, summed
        self.format = torch.float8_e4m3fn
        self.largest = torch.finfo(self.format).max
        self.scaled = original * scale  # exact where the scale is a power of two

    @property
    def along_sum(self) -> bool:
        """The scale varies along the summed dimension: the product cannot divide it out."""
        return self.scale.dim() == 2 and self.scale.shape[self.summed] > 1

    @property
    def clamped(self) -> int:
        return int((self.scaled.abs() > self.largest).sum())

    @property
    def not_power_of_two(self) -> bool:
        import torch

        mantissa, _ = torch.frexp(self.scale)
        return not bool((mantissa == 0.5).all())

    @property
    def unused_range(self) -> int:
        """How many of the scale's groups (rows, columns, the tensor) could take twice the scale
        without a value passing the format's largest."""
        varies = [d for d in range(2) if self.scale.dim() == 2 and self.scale.shape[d] > 1]
        amax = self.original.abs().amax(dim=[d for d in range(2) if d not in varies], keepdim=True)
        return int((amax * self.scale * 2 <= self.largest).sum())

    @property
    def low_share(self) -> float:
        import torch

        return float((self.scaled.abs() < torch.finfo(self.format).smallest_normal).float().mean())

    @property
    def miscast(self) -> int:
        """How many eight-bit values differ from the check's own cast of operand times scale."""
        import torch

        return int((self.eight_bit.view(torch.uint8) != self.scaled.to(self.format).view(torch.uint8)).sum())


def _each(operands, seen):
    return [o for o in operands if seen(o)]


def _names(operands) -> str:
    return " and ".join(o.name for o in operands)


def _too_low(operand) -> bool:
    return operand.low_share > DRAW.low_share


def _miscast(operand) -> bool:
    return operand.miscast > 0


# The answer's operands, judged in this order: the inputs kept, the format, the scales' shapes,
# their values (a power of two first: 448 / amax times amax can round past 448), then what the
# eight-bit values hold. Readings: x's and w's Operands, and whether the answer changed the
# copies it was given.
MISTAKES = (
    Mistake("inputs changed in place", lambda ops, changed: changed,
            "your function changed x or w in place: a model reads them again after the cast (the residual "
            "stream, the weights the optimizer steps). (Hint 3)"),
    Mistake("not e4m3", lambda ops, changed: bool(_each(ops, lambda o: o.eight_bit.dtype != o.format)),
            lambda ops, changed: "the eight-bit " + " and ".join(
                f"{o.name} is {o.eight_bit.dtype}" for o in ops if o.eight_bit.dtype != o.format)
            + ": of the two formats, which keeps each value to 1/16? Activations and weights want its precision. "
              "(Section 16.2, its first cell)"),
    Mistake("a scale along the summed dimension", lambda ops, changed: bool(_each(ops, lambda o: o.along_sum)),
            lambda ops, changed: f"the scale of {_names(_each(ops, lambda o: o.along_sum))} varies along the "
            "dimension that x @ w sums over: each term of one output's sum then carries another scale, and no "
            "division of the result can take them out. (Hint 1)"),
    Mistake("not a power of two", lambda ops, changed: bool(_each(ops, lambda o: o.not_power_of_two)),
            lambda ops, changed: f"the scale of {_names(_each(ops, lambda o: o.not_power_of_two))} is not a "
            "power of two: multiplying by it and dividing the product by it round, so the cast is not the "
            "only rounding. (Hint 2)"),
    Mistake("a scale that clamps", lambda ops, changed: bool(_each(ops, lambda o: o.clamped)),
            lambda ops, changed: "; ".join(f"{o.clamped} values of {o.name} times its scale pass e4m3's largest "
                                           f"value, {o.largest:g}" for o in ops if o.clamped)
            + ": the cast changes them silently. (Hint 2)"),
    Mistake("range left unused", lambda ops, changed: bool(_each(ops, lambda o: o.unused_range)),
            lambda ops, changed: "; ".join(f"{o.unused_range} of {o.name}'s scales could be twice as large "
                                           "without a value passing e4m3's largest" for o in ops if o.unused_range)
            + ": a smaller scale than needed pushes more values below the normal range. (Hint 2)"),
    Mistake("values lost below the normal range", lambda ops, changed: bool(_each(ops, _too_low)),
            lambda ops, changed: "; ".join(f"{o.low_share:.1%} of {o.name}'s values land below e4m3's normal "
                                           "range (their error grows to 100%)" for o in _each(ops, _too_low))
            + f", more than {DRAW.low_share:.0%}: a few outlier tokens or channels set the scale for everything "
              "that shares it. (Hint 1)"),
    Mistake("the eight-bit values are not the scaled operand", lambda ops, changed: bool(_each(ops, _miscast)),
            lambda ops, changed: "; ".join(f"{o.miscast} of the eight-bit {o.name}'s values are not {o.name} "
                                           "times its scale, rounded to e4m3" for o in _each(ops, _miscast))
            + ": what was cast, and in which order? (Hint 3)"),
)


def operands():
    """The check's x and w, drawn with a generator of its own."""
    import torch

    draw = torch.Generator().manual_seed(16)
    x = torch.randn(DRAW.tokens, DRAW.features, generator=draw)
    w = torch.randn(DRAW.features, DRAW.outputs, generator=draw) * 0.02
    x[list(DRAW.outlier_tokens)] *= DRAW.outlier_size
    w[:, list(DRAW.outlier_outputs)] *= DRAW.outlier_size
    return x, w


def _returned(answer, x, w):
    """The answer's four tensors for copies of x and w, and whether it changed the copies."""
    import torch

    x_copy, w_copy = x.clone(), w.clone()
    try:
        returned = answer(x_copy, w_copy)
    except NotImplementedError:
        raise CheckFailed("fp8_operands still raises NotImplementedError: write it first.") from None
    if returned is None:
        raise CheckFailed("your function returned None: return (x8, x_scale, w8, w_scale).")
    if not isinstance(returned, tuple) or len(returned) != 4 or any(type(t) is not torch.Tensor for t in returned):
        raise CheckFailed(f"expected four tensors (x8, x_scale, w8, w_scale), got {returned!r:.200}")
    x8, x_scale, w8, w_scale = returned
    for name, eight_bit, original in (("x8", x8, x), ("w8", w8, w)):
        if eight_bit.shape != original.shape:
            raise CheckFailed(f"{name} has shape {tuple(eight_bit.shape)}, not its operand's {tuple(original.shape)}")
    for name, scale, original in (("x_scale", x_scale, x), ("w_scale", w_scale, w)):
        if scale.dtype != torch.float32 or not bool((scale > 0).all() & scale.isfinite().all()):
            raise CheckFailed(f"{name} must hold positive, finite float32 numbers, got {scale!r:.200}")
        try:
            torch.broadcast_shapes(scale.shape, original.shape)
        except RuntimeError:
            raise CheckFailed(f"{name} has shape {tuple(scale.shape)}, which cannot multiply an operand of shape "
                              f"{tuple(original.shape)}") from None
        if scale.dim() not in (0, 2):
            raise CheckFailed(f"{name} has shape {tuple(scale.shape)}: give it the operand's two dimensions "
                              "(a 1 where it does not vary), as torch._scaled_mm takes it")
    changed = not (torch.equal(x_copy, x) and torch.equal(w_copy, w))
    return (Operand("x", x, x8, x_scale, summed=1), Operand("w", w, w8, w_scale, summed=0)), changed


def _product_error(x, w, ops) -> float:
    """The product as a GPU computes it, and how far it is from x @ w relative to the bound that
    each value's rounding allows: at most 1/16 of a normal value, at most half of e4m3's
    smallest step (2^-10) over the scale below, and float32's accumulation on top."""
    import torch

    ox, ow = ops
    # _scaled_mm takes one scale per tensor for both operands, or one per row of x and one per
    # column of w for both: a single scale is the same number for every row or column.
    rows, columns = ox.original.shape[0], ow.original.shape[1]
    product = torch._scaled_mm(ox.eight_bit, ow.eight_bit, scale_a=(1 / ox.scale).expand(rows, 1).contiguous(),
                               scale_b=(1 / ow.scale).expand(1, columns).contiguous(), out_dtype=torch.float32)
    dx = torch.maximum(x.abs() / 16, 2**-10 / ox.scale)
    dw = torch.maximum(w.abs() / 16, 2**-10 / ow.scale)
    # Two float32 sums of DRAW.features terms (x @ w's and the GEMM's), each off by at most gamma of
    # the sum of the terms' magnitudes (gamma = n u / (1 - n u), u = 2^-24).
    gamma = DRAW.features * 2**-24 / (1 - DRAW.features * 2**-24)
    bound = dx @ w.abs() + (x.abs() + dx) @ dw + 2 * gamma * (x.abs() + dx) @ (w.abs() + dw)
    return float(((product - x @ w).abs() / bound).max())


def check_fp8_operands(answer) -> None:
    """``answer(x, w)`` returns ``(x8, x_scale, w8, w_scale)`` for the FP8 product ``x @ w``."""
    x, w = operands()
    ops, changed = _returned(answer, x, w)
    name_the_first(MISTAKES, ops, changed)
    worst = _product_error(x, w, ops)
    if worst > 1:
        raise CheckFailed(f"torch._scaled_mm of your operands is farther from x @ w than FP8's rounding allows "
                          f"({worst:.2f} times the bound)")
    passed(f"e4m3 operands with power-of-two scales the product divides out, none clamped, "
           f"{max(o.low_share for o in ops):.2%} of values below the normal range at most; torch._scaled_mm "
           f"of them is within {worst:.0%} of FP8's rounding bound of x @ w")
