"""Chapter 16.2's check passes on the solution and names each mistake planted in a copy of it.

The answer is fp8_operands, the solution cell's function; each test changes one piece of it and
calls the check in this process (no rank is started: the check draws its operands and runs
torch._scaled_mm on the CPU)."""

import pytest

from spike_course.checks import CheckFailed, Tampering, check_fp8_operands, ch16_fp8
from named import mistake_of, names
from planting import answer_function, solution_cell

SOLUTION = solution_cell("16_what_large_jobs_run_today", "fp8_operands")
POWER = "torch.exp2(torch.floor(torch.log2(torch.finfo(torch.float8_e4m3fn).max / amax)))"


def planted(old="", new=""):
    return answer_function(SOLUTION, "fp8_operands", old, new)


def test_solution_passes(capsys):
    check_fp8_operands(planted())
    assert "check passed" in capsys.readouterr().out


PLANTS = {  # a mistake (its name, and what tells the plant apart) -> (old, new, what the message says)
    "inputs changed in place": ("x8 = (x * x_scale).to(", "x *= x_scale\n    x8 = (x).to(", "in place"),
    "not e4m3 (e5m2 weights)": ("w8 = (w * w_scale).to(torch.float8_e4m3fn)", "w8 = (w * w_scale).to(torch.float8_e5m2)",
                                "w is torch.float8_e5m2"),
    "not e4m3 (no cast)": ("x8 = (x * x_scale).to(torch.float8_e4m3fn)", "x8 = x * x_scale", "x is torch.float32"),
    "a scale along the summed dimension (w per feature)": ("w.abs().amax(dim=0, keepdim=True)",
                                                           "w.abs().amax(dim=1, keepdim=True)", "scale of w varies"),
    "a scale along the summed dimension (x per feature)": ("x.abs().amax(dim=1, keepdim=True)",
                                                           "x.abs().amax(dim=0, keepdim=True)", "scale of x varies"),
    "a scale that clamps": ("torch.floor(", "torch.ceil(", "values of x times its scale pass e4m3's largest"),
    "not a power of two": (POWER, "torch.finfo(torch.float8_e4m3fn).max / amax", "scale of x and w is not a power"),
    "range left unused": (POWER, POWER + " / 2", "64 of x's scales could be twice as large"),
    "values lost below the normal range (one scale for x)": ("x.abs().amax(dim=1, keepdim=True)",
                                                             "x.abs().amax().reshape(1, 1)", r"of x's values land below"),
    "values lost below the normal range (one scale for w)": ("w.abs().amax(dim=0, keepdim=True)",
                                                             "w.abs().amax().reshape(1, 1)", r"of w's values land below"),
    "the eight-bit values are not the scaled operand": ("x8 = (x * x_scale).to(torch.float8_e4m3fn)",
                                                        "x8 = x.to(torch.float8_e4m3fn)", "of the eight-bit x's values"),
}
CHECK_MODULE = ch16_fp8  # tests/named.py


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_each_mistake_is_named(name):
    old, new, message = PLANTS[name]
    with names(mistake_of(name), says=message):
        check_fp8_operands(planted(old, new))


def test_the_blank_is_named():
    def fp8_operands(x, w):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_fp8_operands(fp8_operands)


def test_a_copy_of_the_lecture_fails():
    """Section 16.2's row_wise, applied to both operands as the lecture applied it (a scale per
    row): w's rows are the summed features."""
    def fp8_operands(x, w):
        import torch

        def row_wise(t):
            scale = torch.exp2(torch.floor(torch.log2(448 / t.abs().amax(dim=1, keepdim=True))))
            return (t * scale).to(torch.float8_e4m3fn), scale

        return (*row_wise(x), *row_wise(w))

    with names("a scale along the summed dimension", says="scale of w varies"):
        check_fp8_operands(fp8_operands)


@pytest.mark.parametrize("returned, says", [
    (lambda x, w: None, "returned None"),
    (lambda x, w: (x, x, w), "expected four tensors"),
    (lambda x, w: (x[:2], x[:, :1], w, w[:1]), "x8 has shape"),
    (lambda x, w: (x, -x[:, :1], w, w[:1]), "positive, finite"),
    (lambda x, w: (x, x[:1, :5].abs() + 1, w, w[:1].abs() + 1), "cannot multiply"),
    (lambda x, w: (x, x[0].abs() + 1, w, w[:1].abs() + 1), "two dimensions"),
])
def test_what_is_not_an_answer_is_refused_with_its_reason(returned, says):
    with pytest.raises(CheckFailed, match=says) as failure:
        check_fp8_operands(returned)
    assert failure.value.mistake is None


def test_an_answer_that_rebinds_the_draw_is_named(monkeypatch):
    """One scale for x, and the check's limit raised from inside the answer: the guard names it."""
    per_tensor = planted("x.abs().amax(dim=1, keepdim=True)", "x.abs().amax().reshape(1, 1)")

    def fp8_operands(x, w):
        monkeypatch.setattr(ch16_fp8, "DRAW", ch16_fp8.Draw(low_share=1.0))
        return per_tensor(x, w)

    with pytest.raises(Tampering, match="ch16_fp8.DRAW"):
        check_fp8_operands(fp8_operands)
