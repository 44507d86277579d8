"""Chapter 05: check_parallel_linear passes right answers and names the likely mistake."""

import pytest
import torch
import torch.nn as nn

from spike_course import checks


def reference():
    torch.manual_seed(0)
    linear = nn.Linear(8, 12)
    x = torch.randn(3, 5, 8, requires_grad=True)
    grad_out = torch.randn(3, 5, 12)
    y = linear(x)
    y.backward(grad_out)
    return {"y": y.detach(), "grad_x": x.grad, "weight": linear.weight.detach(),
            "bias": linear.bias.detach(), "grad_weight": linear.weight.grad,
            "grad_bias": linear.bias.grad, "grad_out": grad_out}


def right_answers(ref, kind, n):
    """What n ranks of a correct layer report."""
    dim = 0 if kind == "column" else 1
    results = {}
    for r in range(n):
        results[r] = {kind: {
            "y": ref["y"].clone(),
            "grad_x": ref["grad_x"].clone() if kind == "column" else ref["grad_x"].chunk(n, -1)[r].clone(),
            "weight": ref["weight"].chunk(n, dim)[r].clone(),
            "grad_weight": ref["grad_weight"].chunk(n, dim)[r].clone(),
            "bias": ref["bias"].chunk(n)[r].clone() if kind == "column" else ref["bias"].clone(),
            "grad_bias": ref["grad_bias"].chunk(n)[r].clone() if kind == "column" else ref["grad_bias"].clone(),
        }}
    return results


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_right_answers_pass(kind, n, capsys):
    ref = reference()
    checks.check_parallel_linear(kind, right_answers(ref, kind, n), ref)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("reshaped", [False, True])
def test_all_gather_concatenated_on_the_batch_dim(n, reshaped):
    ref = reference()
    results = right_answers(ref, "column", n)
    glued = torch.cat(ref["y"].chunk(n, dim=-1), dim=0)
    for r in results:
        results[r]["column"]["y"] = glued.reshape(ref["y"].shape) if reshaped else glued
    with pytest.raises(checks.CheckFailed, match=r"concatenated along dim 0.*dim=-1"):
        checks.check_parallel_linear("column", results, ref)


def test_all_gather_concatenated_on_the_sequence_dim():
    ref = reference()
    results = right_answers(ref, "column", 2)
    for r in results:
        results[r]["column"]["y"] = torch.cat(ref["y"].chunk(2, dim=-1), dim=1)
    with pytest.raises(checks.CheckFailed, match="concatenated along dim 1"):
        checks.check_parallel_linear("column", results, ref)


@pytest.mark.parametrize("n", [2, 4])
def test_bias_added_on_every_rank(n):
    ref = reference()
    results = right_answers(ref, "row", n)
    for r in results:
        results[r]["row"]["y"] = ref["y"] + (n - 1) * ref["bias"]
    with pytest.raises(checks.CheckFailed, match=rf"bias {n} times.*once, after the all-reduce"):
        checks.check_parallel_linear("row", results, ref)


def test_row_outputs_never_all_reduced():
    ref = reference()
    results = right_answers(ref, "row", 2)
    results[0]["row"]["y"] = ref["y"] * 0.3
    with pytest.raises(checks.CheckFailed, match="partial sum"):
        checks.check_parallel_linear("row", results, ref)


def test_column_input_gradient_not_all_reduced():
    ref = reference()
    n = 2
    results = right_answers(ref, "column", n)
    for r in results:
        g_r = ref["grad_out"].chunk(n, dim=-1)[r]
        results[r]["column"]["grad_x"] = g_r @ ref["weight"].chunk(n, dim=0)[r]
    with pytest.raises(checks.CheckFailed, match="only its own share.*all-reduce"):
        checks.check_parallel_linear("column", results, ref)


def test_row_backward_all_reduces_again():
    ref = reference()
    n = 4
    results = right_answers(ref, "row", n)
    for r in results:
        results[r]["row"]["grad_x"] = n * results[r]["row"]["grad_x"]
        results[r]["row"]["grad_weight"] = n * results[r]["row"]["grad_weight"]
    with pytest.raises(checks.CheckFailed, match="world_size times too big.*identity"):
        checks.check_parallel_linear("row", results, ref)


def test_collective_outside_autograd_leaves_no_gradient():
    ref = reference()
    results = right_answers(ref, "column", 2)
    results[1]["column"]["grad_weight"] = None
    with pytest.raises(checks.CheckFailed, match="autograd.Function"):
        checks.check_parallel_linear("column", results, ref)


def test_weight_split_along_the_wrong_dim():
    ref = reference()
    results = right_answers(ref, "column", 2)
    for r in results:
        results[r]["column"]["weight"] = ref["weight"].chunk(2, dim=1)[r]
    with pytest.raises(checks.CheckFailed, match="splits weight along dim 0"):
        checks.check_parallel_linear("column", results, ref)


def test_a_missing_rank_is_reported():
    ref = reference()
    results = right_answers(ref, "row", 2)
    del results[1]["row"]
    with pytest.raises(checks.CheckFailed, match="every rank"):
        checks.check_parallel_linear("row", results, ref)
