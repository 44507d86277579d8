"""Exercise checks for chapter 05: tensor parallel (a vocabulary-parallel embedding, and a
parallelize_module plan for the whole TinyTransformer)."""

from __future__ import annotations

from ._common import CheckFailed, close, passed


def _gap(actual, expected) -> str:
    return f"largest difference {(actual.double() - expected.double()).abs().max().item():.3g}"


# The words an out-of-range lookup raises with: IndexError on the CPU, a device-side assert
# on a GPU.
_INDEX_ERRORS = ("IndexError", "index out of range", "out of bounds", "device-side assert")
# What torch warns when backward runs through a dist.* call autograd has no formula for.
_UNSEEN_COLLECTIVE = "autograd kernel was not registered"


def check_vocab_parallel_embedding(results: dict, reference: dict) -> None:
    """Check a vocabulary-parallel embedding against the unsharded nn.Embedding.

    ``results``: ``launch(...).reports`` of check_embedding.py, rank -> dict with ``world``
    and, as far as the layer got: ``weight`` (its slice of the table), ``y`` (its output),
    ``grad_weight`` (the gradient of its slice), ``warnings``, or ``error`` and ``where``
    (the method of the layer that raised). ``reference``: ``tokens``, ``y``, ``weight`` and
    ``grad_weight`` of the plain nn.Embedding, computed on one process with the same numbers.

    Right answers must match exactly, not within a tolerance: every output row is one row of
    the table plus zeros from the other ranks, and every gradient row sums at most two upstream
    rows (no token occurs three times); x + 0 and a + b are exact in floating point, in any
    order. The named mistakes are matched within float32 rounding, since they sum rows.
    """
    import torch

    ref = {k: v.detach() for k, v in reference.items()}
    tokens, table = ref["tokens"], ref["weight"].double()
    worlds = {got["world"] for got in results.values() if "world" in got}
    if len(worlds) != 1:
        raise CheckFailed(f"no rank reported its world size (got ranks {sorted(results)}): "
                          "did check_embedding.py start? See the output above.")
    n = worlds.pop()
    missing = [r for r in range(n) if r not in results]
    if missing:
        raise CheckFailed(f"ranks {missing} of {n} reported nothing: they failed before the layer "
                          "ran (see their output above).")
    name = f"vocabulary-parallel embedding on {n} ranks"
    vocab, dim = table.shape
    rows = vocab // n
    same = lambda a, b: a.shape == b.shape and torch.equal(a.double(), b.double())  # noqa: E731

    errors = {r: results[r]["error"] for r in range(n) if results[r].get("error")}
    for r, error in errors.items():
        if error.startswith("NotImplementedError"):
            where = results[r].get("where") or "__init__ or forward"
            raise CheckFailed(f"{name}: VocabParallelEmbedding.{where} still raises NotImplementedError "
                              f"(rank {r}): write it.")

    for r in range(n):  # the slice of the table, as far as __init__ got
        weight = results[r].get("weight")
        if weight is None:
            continue
        expected = table[r * rows:(r + 1) * rows]
        if weight.shape != expected.shape:
            hint = (" It is a slice of the EMBEDDING DIMENSION (the columns), ColwiseParallel's split: "
                    "the vocabulary is the rows, dim 0." if weight.shape == (vocab, dim // n) else "")
            raise CheckFailed(f"{name}: rank {r} holds a table of shape {tuple(weight.shape)}, expected "
                              f"{tuple(expected.shape)}: its slice of the vocabulary, rows {r * rows} to "
                              f"{(r + 1) * rows - 1} of embedding.weight (vocab_size, dim) = {(vocab, dim)}, "
                              f"chunk(world_size, dim=0)[rank].{hint}")
        if not same(weight, expected):
            raise CheckFailed(f"{name}: rank {r}'s table has the right shape but not rows {r * rows} to "
                              f"{(r + 1) * rows - 1} of embedding.weight: take chunk(world_size, dim=0)[rank].")

    if errors:  # the first cause, not a rank that failed because another one stopped
        r, error = next(((r, e) for r, e in errors.items() if any(w in e for w in _INDEX_ERRORS)),
                        next(iter(errors.items())))
        where = results[r].get("where")
        if any(w in error for w in _INDEX_ERRORS):
            raise CheckFailed(
                f"{name}: rank {r} looked up a row its slice does not have ({error}). Its table holds "
                f"{rows} rows, token ids {r * rows} to {(r + 1) * rows - 1}, as rows 0 to {rows - 1}: "
                "the tokens were not shifted by start (subtract self.start before the lookup), or a "
                "token outside [start, end) was looked up as it is (give those any valid row first, "
                "then zero their vectors). Rank 0 gets away with a missing shift: its start is 0.")
        raise CheckFailed(f"{name}: rank {r} raised {error}"
                          + (f" in VocabParallelEmbedding.{where}" if where else "") + " (see its traceback above).")

    inside = [(tokens >= r * rows) & (tokens < (r + 1) * rows) for r in range(n)]
    own = [torch.where(inside[r].unsqueeze(-1), table[tokens], 0.0) for r in range(n)]
    for r in range(n):
        y = results[r].get("y")
        if y is None:
            raise CheckFailed(f"{name}: rank {r} reported no output: did forward return one?")
        if same(y, ref["y"]):
            continue
        if y.shape != ref["y"].shape:
            raise CheckFailed(f"{name}: rank {r}'s output has shape {tuple(y.shape)}, expected "
                              f"{tuple(ref['y'].shape)} (the tokens' shape, then the embedding dimension).")
        if n > 1 and close(y, own[r]):
            raise CheckFailed(
                f"{name}: rank {r}'s output holds only the vectors of its own tokens "
                f"(ids {r * rows} to {(r + 1) * rows - 1}), zeros for the others: the all-reduce is "
                "missing. Sum the partial results over the ranks with ReduceFromParallel.apply(partial, "
                "self.group).")
        local = lambda r, t: table[r * rows:(r + 1) * rows][t]  # noqa: E731 - row t of rank r's slice
        row_zero = sum(torch.where(inside[q].unsqueeze(-1), table[tokens], local(q, 0)) for q in range(n))
        clamped = sum(local(q, (tokens - q * rows).clamp(0, rows - 1)) for q in range(n))
        if close(y, row_zero) or close(y, clamped):
            raise CheckFailed(
                f"{name}: rank {r}'s output is each token's vector plus, from every rank that does not "
                f"own it, the row that rank looked it up as ({'its row 0' if close(y, row_zero) else 'a clamped row'}): "
                "the tokens outside [start, end) were not zeroed. Zero their vectors (a mask) before "
                "the sum.")
        raise CheckFailed(f"{name}: rank {r}'s output differs from nn.Embedding's ({_gap(y, ref['y'])}): "
                          "check which row each token is looked up as (global id - start) and that "
                          "the others are zeroed.")

    for r in range(n):
        unseen = [w for w in results[r].get("warnings", []) if _UNSEEN_COLLECTIVE in w]
        if unseen:
            raise CheckFailed(
                f"{name}: rank {r} sums with a plain dist.all_reduce on a tensor autograd tracks; torch "
                f"warned: {unseen[0][:120]!r}... A dist.* call is invisible to autograd: here the "
                "gradient silently passes through unchanged, right for this sum by luck, and torch "
                "deprecates even that (a future release detaches the output: no gradient would reach "
                "the table); the same call elsewhere gives wrong gradients. Use "
                "ReduceFromParallel.apply(partial, self.group).")

    for r in range(n):
        grad, expected = results[r].get("grad_weight"), ref["grad_weight"][r * rows:(r + 1) * rows]
        if grad is None:
            raise CheckFailed(
                f"{name}: rank {r}'s table got no gradient: backward never reached it. A dist.all_reduce "
                "on a detached copy (or under no_grad) cuts the graph: sum the partial results with "
                "ReduceFromParallel.apply(partial, self.group), whose backward passes the gradient on.")
        if same(grad, expected):
            continue
        if n > 1 and close(grad, n * expected):
            raise CheckFailed(
                f"{name}: rank {r}'s table gradient is exactly world_size = {n} times too big: the "
                "backward of the sum all-reduces the gradient again (torch.distributed.nn.functional."
                "all_reduce does). Every rank already holds the whole gradient of the sum: its backward "
                "is the identity, as in ReduceFromParallel.")
        raise CheckFailed(f"{name}: rank {r}'s table gradient is wrong ({_gap(grad, expected)}); each row "
                          "must get the upstream gradients of the tokens it owns (summed when a token "
                          "repeats) and nothing from the others.")
    passed(f"{name}: every rank holds its {rows} rows of the table, returns nn.Embedding's output "
           "and gets its rows of the table's gradient, exactly")


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
    reported (``launch(...).reports``): outputs and gradients against the unsharded model,
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
