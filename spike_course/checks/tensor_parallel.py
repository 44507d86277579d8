"""Exercise checks for chapter 05: tensor parallel (column- and row-parallel linear layers)."""

from __future__ import annotations

from ._common import CheckFailed, passed


_TP_KINDS = ("column", "row")


def _tp_gap(actual, expected) -> str:

    return f"largest difference {(actual.double() - expected.double()).abs().max().item():.3g}"


def check_parallel_linear(kind: str, results: dict, reference: dict,
                          rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Check a column- or row-parallel linear layer against the unsharded nn.Linear.

    ``results``: ``launch(...).results``, rank -> dict whose ``results[rank][kind]`` holds
    what that rank's layer gave: ``y`` (the output), ``grad_x`` (gradient of its input:
    the whole input for "column", its slice of the input features for "row"),
    ``weight``/``grad_weight`` and ``bias``/``grad_bias`` (its local parameters).
    ``reference``: ``y``, ``grad_x``, ``weight``, ``bias``, ``grad_weight``, ``grad_bias``
    of the plain nn.Linear, computed on one process with the same numbers.
    """
    import torch

    if kind not in _TP_KINDS:
        raise ValueError(f"kind must be one of {_TP_KINDS}, got {kind!r}")
    ranks = sorted(results)
    n = len(ranks)
    if ranks != list(range(n)) or any(kind not in results[r] for r in ranks):
        raise CheckFailed(f"expected a {kind!r} entry from every rank 0..{n - 1}; got ranks {ranks}. "
                          "Did every rank run the check script to the end?")
    ref = {k: v.detach().double() for k, v in reference.items()}
    same = lambda a, b: a.shape == b.shape and torch.allclose(a.double(), b, rtol=rtol, atol=atol)  # noqa: E731
    name = f"{kind}-parallel linear on {n} ranks"
    shard_dim = 0 if kind == "column" else 1

    for r in ranks:
        got = results[r][kind]
        y = got.get("y")
        if y is None:
            raise CheckFailed(f"{name}: rank {r} reported no output.")
        y = y.double()
        if not same(y, ref["y"]):
            _tp_explain_output(name, kind, r, n, y, ref, same)

    for r in ranks:
        got = results[r][kind]
        for key in ("grad_x", "grad_weight") + (("grad_bias",) if ref.get("bias") is not None else ()):
            if got.get(key) is None:
                raise CheckFailed(
                    f"{name}: rank {r} has no {key}: the gradient never reached it. A dist.* call "
                    "on a tensor is invisible to autograd (all_gather fills fresh tensors that have no "
                    "history): put each collective in a torch.autograd.Function with its backward.")
        w_expected = ref["weight"].chunk(n, dim=shard_dim)[r]
        if not same(got["weight"], w_expected):
            raise CheckFailed(
                f"{name}: rank {r} holds a weight of shape {tuple(got['weight'].shape)}, expected its "
                f"slice {tuple(w_expected.shape)} of nn.Linear.weight (out, in) = {tuple(ref['weight'].shape)}. "
                f"{kind.capitalize()} parallel splits weight along dim {shard_dim} "
                f"({'its rows: the output features' if kind == 'column' else 'its columns: the input features'}); "
                "take chunk(world_size, dim)[rank].")

        gx = got["grad_x"].double()
        if kind == "column":
            gx_expected = ref["grad_x"]
            share = sum(results[q][kind]["grad_x"].double() for q in ranks)
            if n > 1 and not same(gx, gx_expected) and same(share, gx_expected):
                raise CheckFailed(
                    f"{name}: rank {r}'s input gradient is only its own share: each rank's weight slice "
                    "gives part of dL/dx, and the parts must be summed. The copy of x into the parallel "
                    "region needs backward = all-reduce of the gradient (forward = identity).")
        else:
            gx_expected = ref["grad_x"].chunk(n, dim=-1)[r]
        if not same(gx, gx_expected):
            hint = (" It is exactly world_size times too big: the backward of the forward all-reduce "
                    "must pass the gradient through unchanged (identity), not all-reduce it again."
                    if n > 1 and same(gx, n * gx_expected) else "")
            raise CheckFailed(f"{name}: rank {r}'s input gradient is wrong ({_tp_gap(gx, gx_expected)}).{hint}")

        gw, gw_expected = got["grad_weight"].double(), ref["grad_weight"].chunk(n, dim=shard_dim)[r]
        if not same(gw, gw_expected):
            hint = (" It is exactly world_size times too big: a backward all-reduces a gradient that "
                    "every rank already holds in full." if n > 1 and same(gw, n * gw_expected) else "")
            raise CheckFailed(f"{name}: rank {r}'s weight gradient is wrong ({_tp_gap(gw, gw_expected)}).{hint}")
        if ref.get("bias") is not None:
            gb = got["grad_bias"].double()
            gb_expected = ref["grad_bias"].chunk(n)[r] if kind == "column" else ref["grad_bias"]
            if not same(gb, gb_expected):
                raise CheckFailed(f"{name}: rank {r}'s bias gradient is wrong ({_tp_gap(gb, gb_expected)}); "
                                  + ("each rank owns the bias of its output features: chunk the bias like "
                                     "the weight's rows." if kind == "column" else
                                     "every rank holds the whole bias, added once after the all-reduce."))
    passed(f"{name}: output and every gradient match nn.Linear")


def _tp_explain_output(name, kind, r, n, y, ref, same):
    """Raise CheckFailed naming the most likely reason why rank r's output is wrong."""
    import torch

    y_ref = ref["y"]
    chunks = y_ref.chunk(n, dim=-1)
    for dim in range(y_ref.ndim - 1):  # the shards glued along a wrong dimension
        glued = torch.cat(chunks, dim=dim)
        if same(y, glued) or (y.shape == y_ref.shape and same(y, glued.reshape(y_ref.shape))):
            raise CheckFailed(
                f"{name}: rank {r}'s output has the {n} shards concatenated along dim {dim} "
                f"(shape {tuple(glued.shape)}"
                + (", then reshaped" if y.shape == y_ref.shape else "") +
                "). Each shard holds some OUTPUT FEATURES of every row, so the all-gathered pieces "
                "go side by side along the last dim: torch.cat(pieces, dim=-1).")
    bias = ref.get("bias")
    if kind == "row" and bias is not None and n > 1:
        if same(y, y_ref + (n - 1) * bias):
            raise CheckFailed(
                f"{name}: rank {r}'s output has the bias {n} times: every rank added it before the "
                "all-reduce, which sums the copies. Add the bias once, after the all-reduce.")
        if same(y, y_ref - bias):
            raise CheckFailed(f"{name}: the bias is missing from rank {r}'s output: add it after the all-reduce.")
    if y.shape != y_ref.shape:
        raise CheckFailed(f"{name}: rank {r}'s output has shape {tuple(y.shape)}, expected {tuple(y_ref.shape)}"
                          + (": the shards were never gathered." if y.shape[-1] * n == y_ref.shape[-1] else "."))
    if kind == "row" and n > 1:
        raise CheckFailed(f"{name}: rank {r}'s output is wrong ({_tp_gap(y, y_ref)}). Each rank's product "
                          "is a partial sum over its input features: all-reduce (sum) it, then add the bias.")
    raise CheckFailed(f"{name}: rank {r}'s output is wrong ({_tp_gap(y, y_ref)}).")
