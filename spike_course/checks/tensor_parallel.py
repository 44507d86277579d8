"""Exercise checks for chapter 05: tensor parallel (a vocabulary-parallel embedding, and a
parallelize_module plan for the whole TinyTransformer).

Each check is a short list of steps, one per aspect of the answer, in the order a learner
meets them; a step raises CheckFailed with a message that names the mistake. Mistakes that
are recognised by the numbers a wrong answer gives are listed in tables (name -> how to
recognise it -> message)."""

from __future__ import annotations

from ._common import CheckFailed, close, launch_reports, passed


def _gap(actual, expected) -> str:
    return f"largest difference {(actual.double() - expected.double()).abs().max().item():.3g}"


# --- exercise 1: a vocabulary-parallel embedding ---------------------------------------

# The words an out-of-range lookup raises with: IndexError on the CPU, a device-side assert
# on a GPU.
_INDEX_ERRORS = ("IndexError", "index out of range", "out of bounds", "device-side assert")
# What torch warns when backward runs through a dist.* call autograd has no formula for.
_UNSEEN_COLLECTIVE = "autograd kernel was not registered"


def _same(a, b) -> bool:
    """Exactly equal. Right answers must match exactly, not within a tolerance: every output
    row is one row of the table plus zeros from the other ranks, and every gradient row sums
    at most two upstream rows (no token occurs three times); x + 0 and a + b are exact in
    floating point, in any order. The named mistakes are matched with ``close`` (within
    float32 rounding), since they sum rows."""
    import torch

    return a.shape == b.shape and torch.equal(a.double(), b.double())


class _VocabSplit:
    """The unsharded embedding (``reference``) and how ``n`` ranks split its rows: what every
    step reads, and the outputs that the named mistakes give."""

    def __init__(self, reference: dict, n: int):
        self.tokens, self.table = reference["tokens"], reference["weight"].double()
        self.y, self.grad_weight = reference["y"], reference["grad_weight"]
        self.n, self.vocab, self.dim = n, *self.table.shape
        self.rows = self.vocab // n  # each rank's share; a rank owns token ids [start, end)
        self.name = f"vocabulary-parallel embedding on {n} ranks"

    def fail(self, message: str) -> CheckFailed:
        return CheckFailed(f"{self.name}: {message}")

    def about(self, r: int) -> dict:
        """What a message says about rank r: its rows are token ids first to last."""
        return dict(r=r, n=self.n, rows=self.rows, first=r * self.rows, last=(r + 1) * self.rows - 1)

    def rows_of(self, r: int, full):
        """Rank r's share of the rows of ``full`` (the table, or its gradient)."""
        return full[r * self.rows:(r + 1) * self.rows]

    def owns(self, r: int):
        """Which tokens rank r owns: ids in [start, end)."""
        return (self.tokens >= r * self.rows) & (self.tokens < (r + 1) * self.rows)

    def partial(self, r: int):
        """Rank r's partial result, before the sum: its tokens' vectors, zeros for the others."""
        import torch

        return torch.where(self.owns(r).unsqueeze(-1), self.table[self.tokens], 0.0)

    def sum_if_row_zero(self):
        """The sum over ranks when each rank looks up the tokens it does not own as its row 0
        and does not zero them."""
        import torch

        right = self.table[self.tokens]
        return sum(torch.where(self.owns(q).unsqueeze(-1), right, self.rows_of(q, self.table)[0])
                   for q in range(self.n))

    def sum_if_clamped(self):
        """The sum over ranks when each rank clamps every token id into its slice and does not
        zero the tokens it does not own."""
        return sum(self.rows_of(q, self.table)[(self.tokens - q * self.rows).clamp(0, self.rows - 1)]
                   for q in range(self.n))


def _not_zeroed(row: str) -> str:
    return ("rank {r}'s output is each token's vector plus, from every rank that does not own it, "
            f"the row that rank looked it up as ({row}): the tokens outside [start, end) were not "
            "zeroed. Zero their vectors (a mask) before the sum.")


# The wrong outputs the exercise names, tried in this order on rank r's output y (of the
# right shape): name -> (does y show it?, the message, formatted with _VocabSplit.about).
_OUTPUT_MISTAKES = {
    "partial results not summed": (
        lambda split, r, y: split.n > 1 and close(y, split.partial(r)),
        "rank {r}'s output holds only the vectors of its own tokens (ids {first} to {last}), zeros for "
        "the others: the partial results were never summed over the ranks (Hint 1; the given "
        "Function is in Hint 2)."),
    "outside tokens not zeroed (looked up as row 0)": (
        lambda split, r, y: close(y, split.sum_if_row_zero()), _not_zeroed("its row 0")),
    "outside tokens not zeroed (clamped into the slice)": (
        lambda split, r, y: close(y, split.sum_if_clamped()), _not_zeroed("a clamped row")),
}


def _world_size(results: dict) -> int:
    """The world size every rank reported, once every rank has reported."""
    worlds = {got["world"] for got in results.values() if "world" in got}
    if len(worlds) != 1:
        raise CheckFailed(f"no rank reported its world size (got ranks {sorted(results)}): "
                          "did check_embedding.py start? See the output above.")
    n = worlds.pop()
    missing = [r for r in range(n) if r not in results]
    if missing:
        raise CheckFailed(f"ranks {missing} of {n} reported nothing: they failed before the layer "
                          "ran (see their output above).")
    return n


def _errors(results: dict, n: int) -> dict:
    """rank -> the error it raised, for the ranks that raised."""
    return {r: results[r]["error"] for r in range(n) if results[r].get("error")}


def _check_written(results: dict, split: _VocabSplit) -> None:
    """No rank stopped at the exercise's `raise NotImplementedError`."""
    for r, error in _errors(results, split.n).items():
        if error.startswith("NotImplementedError"):
            where = results[r].get("where") or "__init__ or forward"
            raise split.fail(f"VocabParallelEmbedding.{where} still raises NotImplementedError "
                             f"(rank {r}): write it.")


def _check_slices(results: dict, split: _VocabSplit) -> None:
    """Each rank's slice of the table, as far as __init__ got: rows start..end-1."""
    vocab, dim, n = split.vocab, split.dim, split.n
    for r in range(n):
        weight = results[r].get("weight")
        if weight is None:
            continue
        expected, span = split.rows_of(r, split.table), "rows {first} to {last}".format(**split.about(r))
        if weight.shape != expected.shape:
            # (vocab, dim / n) is a split of the columns: recognised from the shape alone
            hint = (" It is a slice of the EMBEDDING DIMENSION (the columns), ColwiseParallel's split: "
                    "the vocabulary is the rows, dim 0." if weight.shape == (vocab, dim // n) else "")
            raise split.fail(f"rank {r} holds a table of shape {tuple(weight.shape)}, expected "
                             f"{tuple(expected.shape)}: its slice of the vocabulary, {span} of "
                             f"embedding.weight (vocab_size, dim) = {(vocab, dim)}, "
                             f"chunk(world_size, dim=0)[rank].{hint}")
        if not _same(weight, expected):
            raise split.fail(f"rank {r}'s table has the right shape but not {span} of embedding.weight: "
                             "take chunk(world_size, dim=0)[rank].")


def _check_no_error(results: dict, split: _VocabSplit) -> None:
    """A rank that raised, told by its first cause: a lookup outside a rank's slice stops that
    rank, and the others then fail too, waiting for it in the all-reduce."""
    errors = _errors(results, split.n)
    if not errors:
        return
    looked_outside = [r for r, error in errors.items() if any(w in error for w in _INDEX_ERRORS)]
    if looked_outside:
        r = looked_outside[0]
        raise split.fail(
            "rank {r} looked up a row its slice does not have ({error}). Its table holds {rows} rows, "
            "token ids {first} to {last}, as rows 0 to {top}: the tokens were not shifted by start, "
            "or a token outside [start, end) was looked up as it is (Hint 1). Rank 0 gets away with a "
            "missing shift: its start is 0.".format(error=errors[r], top=split.rows - 1, **split.about(r)))
    r, error = next(iter(errors.items()))
    where = results[r].get("where")
    raise split.fail(f"rank {r} raised {error}" + (f" in VocabParallelEmbedding.{where}" if where else "")
                     + " (see its traceback above).")


def _check_held(results: dict, split: _VocabSplit) -> None:
    """What the worker measured, whatever the layer reports as its weight: the elements of
    every tensor the layer keeps."""
    for r in range(split.n):
        held = results[r].get("held")
        if held is not None and split.n > 1 and held > split.rows * split.dim:
            raise split.fail(
                f"rank {r}'s layer keeps {held} elements in its tensors (parameters, buffers and "
                f"attributes), but its rows of the table are {split.rows * split.dim}: it holds more "
                "of the table than its own rows, so the table is not split (Hint 1).")


def _check_summed(results: dict, split: _VocabSplit) -> None:
    """Whole outputs with no collective in the forward (CommDebugMode, in the worker): the
    rank had the other rows from somewhere else than the other ranks."""
    for r in range(split.n):
        if results[r].get("forward_collectives") == 0 and split.n > 1:
            raise split.fail(
                f"rank {r}'s forward ran no collective, yet it returned every token's vector: no "
                "rank can know the vectors of the tokens outside its rows but from the other ranks; "
                "it read them from a copy of the table (Hint 1).")


def _check_outputs(results: dict, split: _VocabSplit) -> None:
    """Every rank returns nn.Embedding's output, exactly; else the first named mistake it shows."""
    for r in range(split.n):
        y = results[r].get("y")
        if y is None:
            raise split.fail(f"rank {r} reported no output: did forward return one?")
        if _same(y, split.y):
            continue
        if y.shape != split.y.shape:
            raise split.fail(f"rank {r}'s output has shape {tuple(y.shape)}, expected "
                             f"{tuple(split.y.shape)} (the tokens' shape, then the embedding dimension).")
        for shows, message in _OUTPUT_MISTAKES.values():
            if shows(split, r, y):
                raise split.fail(message.format(**split.about(r)))
        raise split.fail(f"rank {r}'s output differs from nn.Embedding's ({_gap(y, split.y)}): check "
                         "which row each token is looked up as (global id - start) and that the others "
                         "are zeroed.")


def _check_sum_seen_by_autograd(results: dict, split: _VocabSplit) -> None:
    """A plain dist.all_reduce gives the right output and here, by luck, the right gradient:
    torch's warning is what tells it apart."""
    for r in range(split.n):
        unseen = [w for w in results[r].get("warnings", []) if _UNSEEN_COLLECTIVE in w]
        if unseen:
            raise split.fail(
                f"rank {r} sums with a plain dist.all_reduce on a tensor autograd tracks; torch "
                f"warned: {unseen[0][:120]!r}... A dist.* call is invisible to autograd: here the "
                "gradient silently passes through unchanged, right for this sum by luck, and torch "
                "deprecates even that (a future release detaches the output: no gradient would reach "
                "the table); the same call elsewhere gives wrong gradients. The given Function is "
                "there for this sum (Hint 1).")


def _check_gradients(results: dict, split: _VocabSplit) -> None:
    """Every rank gets its rows of the table's gradient, exactly."""
    n = split.n
    for r in range(n):
        grad, expected = results[r].get("grad_weight"), split.rows_of(r, split.grad_weight)
        if grad is None:
            raise split.fail(
                f"rank {r}'s table got no gradient: backward never reached it. A dist.all_reduce "
                "on a detached copy (or under no_grad) cuts the graph; the given Function's backward "
                "passes the gradient on (Hint 1).")
        if _same(grad, expected):
            continue
        if n > 1 and close(grad, n * expected):  # the sum's backward all-reduced the gradient again
            raise split.fail(
                f"rank {r}'s table gradient is exactly world_size = {n} times too big: the "
                "backward of the sum all-reduces the gradient again (torch.distributed.nn.functional."
                "all_reduce does). Every rank already holds the whole gradient of the sum: its backward "
                "is the identity, as in ReduceFromParallel.")
        raise split.fail(f"rank {r}'s table gradient is wrong ({_gap(grad, expected)}); each row "
                         "must get the upstream gradients of the tokens it owns (summed when a token "
                         "repeats) and nothing from the others.")


def check_vocab_parallel_embedding(results: dict, reference: dict) -> None:
    """Check a vocabulary-parallel embedding against the unsharded nn.Embedding.

    ``results``: ``launch(...).reports`` of check_embedding.py, rank -> dict with ``world``
    and, as far as the layer got: ``weight`` (its slice of the table), ``y`` (its output),
    ``grad_weight`` (the gradient of its slice), ``warnings``, or ``error`` and ``where``
    (the method of the layer that raised). ``reference``: ``tokens``, ``y``, ``weight`` and
    ``grad_weight`` of the plain nn.Embedding, computed on one process with the same numbers.
    Right answers must match exactly (see ``_same``).
    """
    reference = {k: v.detach() for k, v in reference.items()}
    split = _VocabSplit(reference, _world_size(results))
    _check_written(results, split)
    _check_slices(results, split)
    _check_no_error(results, split)  # after the slices: a wrong slice is the cause of what fails later
    _check_held(results, split)
    _check_outputs(results, split)
    _check_summed(results, split)
    _check_sum_seen_by_autograd(results, split)
    _check_gradients(results, split)
    passed(f"{split.name}: every rank holds its {split.rows} rows of the table, returns nn.Embedding's "
           "output and gets its rows of the table's gradient, exactly")


# --- exercise 2: a parallelize_module plan for the whole TinyTransformer ---------------

# Megatron's count per transformer layer: one all-reduce after attention and one after the
# MLP in forward, the same two (of the input gradients) in backward.
_PER_LAYER = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
# How many column layers read each region's input: when they do not share one replicated
# input, backward all-reduces the input gradient once per column layer, inside the region.
_COLUMN_LAYERS = {"attention": 3, "feed_forward": 2}


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


def _ranks_that_ran(results: dict, plan: str) -> list:
    ranks = sorted(results)
    if not ranks or any(plan not in results[r].get("plans", {}) for r in ranks):
        raise CheckFailed(f"no result for {plan!r} from every rank: did check_plan.py run to the end?")
    return ranks


def _unsharded(config: dict, tokens):
    """The unsharded TinyTransformer the worker built (same seed, float64), after one backward
    of the worker's loss; and its logits."""
    import torch
    import torch.nn.functional as F

    from ..models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(**config).double()
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return model, logits


def _check_ran(got: dict, where: str, named: str | None) -> None:
    if got["error"]:
        if "NotImplementedError" in got["error"]:
            raise CheckFailed("parallelize() still raises NotImplementedError: write the plan.")
        raise CheckFailed(where + (named or "the sharded model failed") + f"\n(it raised {got['error']})")


def _check_numbers(got: dict, where: str, named: str | None, unsharded, logits, rtol: float,
                   atol: float) -> None:
    """Logits and every gradient against the unsharded model's; a named plan mistake says why."""
    import torch

    y = got["logits"]
    if y.shape != logits.shape:
        raise CheckFailed(where + (named or f"the logits have shape {tuple(y.shape)}, expected "
                                   f"{tuple(logits.shape)}: every rank must see all of them "
                                   "(output_layouts=Replicate())."))
    if not torch.allclose(y.double(), logits.detach(), rtol=rtol, atol=atol):
        gap = (y.double() - logits.detach()).abs().max().item()
        raise CheckFailed(where + (named or "the logits differ from the unsharded model's") +
                          f" (largest difference {gap:.3g})")
    for name, param in unsharded.named_parameters():
        grad = got["grads"].get(name)
        if grad is None or not torch.allclose(grad.double(), param.grad, rtol=rtol, atol=atol):
            raise CheckFailed(where + f"the gradient of {name} differs from the unsharded model's" +
                              (f": {named}" if named else "."))


def _check_rank(got: dict, where: str, unsharded, logits, rtol: float, atol: float) -> None:
    """One rank's run of the plan: it sharded something, ran, and computed the unsharded
    model's numbers. A plan mistake recognised from the styles comes first in every message:
    it is the cause, the numbers only its symptom."""
    if not got["plan"] and not got["error"]:
        raise CheckFailed("parallelize() never called parallelize_module: nothing is sharded.")
    named = _named_plan_mistake(got["plan"])
    _check_ran(got, where, named)
    _check_numbers(got, where, named, unsharded, logits, rtol, atol)


def _check_all_sharded(placements: dict, unsharded) -> int:
    """Every weight but the norms' and the position embedding's is sharded; returns how many."""
    must_shard = [n for n, p in unsharded.named_parameters()
                  if n.endswith("weight") and ("norm" not in n) and ("pos_embeddings" not in n)]
    plain = [n for n in must_shard if "Shard" not in placements.get(n, "")]
    if plain:
        raise CheckFailed(f"{len(plain)} weight{'s are' if len(plain) > 1 else ' is'} not sharded, e.g. "
                          f"{plain[0]}: every rank holds all of it. "
                          "Tensor parallel splits every linear layer and the token embedding "
                          "(RowwiseParallel(input_layouts=Replicate()) splits the vocabulary).")
    return len(must_shard)


def _why_extra_all_reduces(comm: dict, fqn: str) -> str:
    """The hint for a layer with other collectives than Megatron's: the regions whose column
    layers each all-reduced their own input gradient, when that shows."""
    extra = [f"{region} all-reduces {columns} input gradients in backward, one per column layer"
             for region, columns in _COLUMN_LAYERS.items()
             if comm.get(f"{fqn}.{region}", {}).get("backward", {}).get("all_reduce", 0) == columns]
    if not extra:
        return (" Megatron's layer needs one all-reduce after attention and one after the MLP, in forward "
                "and in backward.")
    return ("; ".join(extra) + ". Give the module one shared replicated input: "
            "PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), "
            "use_local_output=False) on it, so its input gradient is all-reduced once.")


def _check_collectives(comm: dict, n_layers: int) -> None:
    """Megatron's two all-reduces per layer in forward and two in backward (CommDebugMode's counts)."""
    for layer in range(n_layers):
        fqn = f"TinyTransformer.layers.{layer}"
        counts = comm.get(fqn, {"forward": {}, "backward": {}})
        if counts != _PER_LAYER:
            raise CheckFailed(f"layers.{layer} does forward {counts['forward']} and backward "
                              f"{counts['backward']}, expected {_PER_LAYER['forward']} and "
                              f"{_PER_LAYER['backward']}: " + _why_extra_all_reduces(comm, fqn))


def check_tp_plan(results, plan: str = "tp_plan", rtol: float = 1e-9, atol: float = 1e-12) -> None:
    """Check a ``parallelize(model, mesh)`` plan for the TinyTransformer from what check_plan.py
    reported (``launch(...).reports``): outputs and gradients against the unsharded model,
    every weight sharded, and Megatron's collectives per layer (CommDebugMode).

    The worker runs in float64: the sharded model adds partial sums in another order than
    the unsharded one, and in float64 that changes a result by a few units of 2**-53 times
    the sizes summed, far below ``rtol``; each mistake named here changes it by 1e-3 or more.
    """
    results = launch_reports(results, f"the plan in {plan}.py")  # a launch (check=False) or its reports
    ranks = _ranks_that_ran(results, plan)
    config = results[0]["config"]
    unsharded, logits = _unsharded(config, results[0]["tokens"])
    for r in ranks:
        _check_rank(results[r]["plans"][plan], f"rank {r} of {len(ranks)}: ", unsharded, logits, rtol, atol)
    got = results[0]["plans"][plan]  # placements and collectives are the same on every rank
    sharded = _check_all_sharded(got["placements"], unsharded)
    _check_collectives(got["comm"], config["n_layers"])
    passed(f"plan {plan!r} on {len(ranks)} ranks: logits, loss and all {sharded} sharded weights' gradients "
           "match the unsharded model, 2 all-reduces per layer forward and 2 backward")
