"""Exercise checks for chapter 05: tensor parallel (column- and row-parallel linear layers)."""

from __future__ import annotations

from ._common import CheckFailed, passed


_LAYER_KINDS = ("column", "row")


def _gap(actual, expected) -> str:
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

    if kind not in _LAYER_KINDS:
        raise ValueError(f"kind must be one of {_LAYER_KINDS}, got {kind!r}")
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
            _explain_output(name, kind, r, n, y, ref, same)

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
            raise CheckFailed(f"{name}: rank {r}'s input gradient is wrong ({_gap(gx, gx_expected)}).{hint}")

        gw, gw_expected = got["grad_weight"].double(), ref["grad_weight"].chunk(n, dim=shard_dim)[r]
        if not same(gw, gw_expected):
            hint = (" It is exactly world_size times too big: a backward all-reduces a gradient that "
                    "every rank already holds in full." if n > 1 and same(gw, n * gw_expected) else "")
            raise CheckFailed(f"{name}: rank {r}'s weight gradient is wrong ({_gap(gw, gw_expected)}).{hint}")
        if ref.get("bias") is not None:
            gb = got["grad_bias"].double()
            gb_expected = ref["grad_bias"].chunk(n)[r] if kind == "column" else ref["grad_bias"]
            if not same(gb, gb_expected):
                raise CheckFailed(f"{name}: rank {r}'s bias gradient is wrong ({_gap(gb, gb_expected)}); "
                                  + ("each rank owns the bias of its output features: chunk the bias like "
                                     "the weight's rows." if kind == "column" else
                                     "every rank holds the whole bias, added once after the all-reduce."))
    passed(f"{name}: output and every gradient match nn.Linear")


def _explain_output(name, kind, r, n, y, ref, same):
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
        raise CheckFailed(f"{name}: rank {r}'s output is wrong ({_gap(y, y_ref)}). Each rank's product "
                          "is a partial sum over its input features: all-reduce (sum) it, then add the bias.")
    raise CheckFailed(f"{name}: rank {r}'s output is wrong ({_gap(y, y_ref)}).")


# --- exercise 2: a parallelize_module plan for the whole TinyTransformer ---------------

# Megatron's count per transformer layer: one all-reduce after attention and one after the
# MLP in forward, the same two (of the input gradients) in backward.
_PER_LAYER = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}


def _style_of(plan: dict, target: str):
    """The style the plan gives module ``target`` (e.g. layers.0.feed_forward.w2), or None;
    plan keys may use wildcards (layers.*.attention.wq)."""
    from fnmatch import fnmatchcase

    found = [v for k, v in plan.items() if fnmatchcase(target, k)]
    return found[-1] if found else None


def _named_plan_mistake(plan: dict) -> str | None:
    """A classic plan mistake, read from the styles the plan gave (None when none shows)."""
    def kind(target):
        style = _style_of(plan, target)
        return style and style["style"]

    regions = {"feed_forward": (("w1", "w3"), "w2", "hidden units"),
               "attention": (("wq", "wk", "wv"), "wo", "heads")}
    for region, (columns, row, features) in regions.items():
        first = [kind(f"layers.0.{region}.{c}") for c in columns]
        last = kind(f"layers.0.{region}.{row}")
        names = ", ".join(columns)
        if last == "ColwiseParallel" and "ColwiseParallel" in first:
            return (f"{region}.{row} is ColwiseParallel like {names}. A column layer's output is its "
                    f"slice of the features ({region}'s {features}): the layer after it must "
                    f"take that slice as input and sum the partial results, RowwiseParallel.")
        if last == "ColwiseParallel" and "RowwiseParallel" in first:
            return (f"{region}: {names} are RowwiseParallel and {row} ColwiseParallel, the wrong way "
                    "round. The first layers take the whole (replicated) input and split the output "
                    f"features (ColwiseParallel); {row} takes those slices and all-reduces (RowwiseParallel).")
    output = _style_of(plan, "output")
    if output and "Replicate" not in output["output_layouts"]:
        return ("output is ColwiseParallel without output_layouts=Replicate(): each rank gets only its "
                "vocabulary slice of the logits, and the loss needs all of them.")
    return None


def check_tp_plan(results: dict, plan: str = "tp_plan", rtol: float = 1e-9, atol: float = 1e-12) -> None:
    """Check a ``parallelize(model, mesh)`` plan for the TinyTransformer from what check_plan.py
    reported (``launch(...).results``): outputs and gradients against the unsharded model,
    every weight sharded, and Megatron's collectives per layer (CommDebugMode).

    The worker runs in float64: the sharded model adds partial sums in another order than
    the unsharded one, and in float64 that changes a result by a few units of 2**-53 times
    the sizes summed, far below ``rtol``; each mistake named here changes it by 1e-3 or more.
    """
    import torch
    import torch.nn.functional as F

    from ..models import TinyTransformer

    ranks = sorted(results)
    if not ranks or any(plan not in results[r].get("plans", {}) for r in ranks):
        raise CheckFailed(f"no result for {plan!r} from every rank: did check_plan.py run to the end?")
    config, tokens = results[0]["config"], results[0]["tokens"]
    torch.manual_seed(0)
    reference = TinyTransformer(**config).double()
    logits = reference(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    n = len(ranks)

    for r in ranks:
        got = results[r]["plans"][plan]
        where = f"rank {r} of {n}: "
        if not got["plan"] and not got["error"]:
            raise CheckFailed("parallelize() never called parallelize_module: nothing is sharded.")
        named = _named_plan_mistake(got["plan"])
        if got["error"]:
            if "NotImplementedError" in got["error"]:
                raise CheckFailed("parallelize() still raises NotImplementedError: write the plan.")
            raise CheckFailed(where + (named or "the sharded model failed") + f"\n(it raised {got['error']})")
        y = got["logits"]
        if y.shape != logits.shape:
            message = named or (f"the logits have shape {tuple(y.shape)}, expected {tuple(logits.shape)}: "
                                "every rank must see all of them (output_layouts=Replicate()).")
            raise CheckFailed(where + message)
        if not torch.allclose(y.double(), logits.detach(), rtol=rtol, atol=atol):
            gap = (y.double() - logits.detach()).abs().max().item()
            raise CheckFailed(where + (named or "the logits differ from the unsharded model's") +
                              f" (largest difference {gap:.3g})")
        for name, param in reference.named_parameters():
            grad = got["grads"].get(name)
            if grad is None or not torch.allclose(grad.double(), param.grad, rtol=rtol, atol=atol):
                raise CheckFailed(where + f"the gradient of {name} differs from the unsharded model's" +
                                  (f": {named}" if named else "."))

    got = results[0]["plans"][plan]
    must_shard = [n for n, p in reference.named_parameters()
                  if n.endswith("weight") and ("norm" not in n) and ("pos_embeddings" not in n)]
    plain = [n for n in must_shard if "Shard" not in got["placements"].get(n, "")]
    if plain:
        raise CheckFailed(f"{len(plain)} weight{'s are' if len(plain) > 1 else ' is'} not sharded, e.g. "
                          f"{plain[0]}: every rank holds all of it. "
                          "Tensor parallel splits every linear layer and the token embedding "
                          "(RowwiseParallel(input_layouts=Replicate()) splits the vocabulary).")

    for layer in range(config["n_layers"]):
        fqn = f"TinyTransformer.layers.{layer}"
        counts = got["comm"].get(fqn, {"forward": {}, "backward": {}})
        if counts == _PER_LAYER:
            continue
        extra = []
        for region, columns in (("attention", 3), ("feed_forward", 2)):
            inner = got["comm"].get(f"{fqn}.{region}", {}).get("backward", {}).get("all_reduce", 0)
            if inner == columns:
                extra.append(f"{region} all-reduces {columns} input gradients in backward, one per "
                             "column layer")
        hint = ("; ".join(extra) + ". Give the module one shared replicated input: "
                "PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), "
                "use_local_output=False) on it, so its input gradient is all-reduced once."
                if extra else " Megatron's layer needs one all-reduce after attention and one after the "
                "MLP, in forward and in backward.")
        raise CheckFailed(f"layers.{layer} does forward {counts['forward']} and backward {counts['backward']}, "
                          f"expected {_PER_LAYER['forward']} and {_PER_LAYER['backward']}: " + hint)
    passed(f"plan {plan!r} on {n} ranks: logits, loss and all {len(must_shard)} sharded weights' gradients "
           "match the unsharded model, 2 all-reduces per layer forward and 2 backward")
