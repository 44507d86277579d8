"""Exercise checks for chapter 05: tensor parallel (a vocabulary-parallel embedding, and a
parallelize_module plan for the whole TinyTransformer).

Each check is a short list of steps, one per aspect of the answer, in the order a learner
meets them; a step raises CheckFailed with a message that names the mistake. Mistakes that
are recognised by the numbers a wrong answer gives are listed in tables (name -> how to
recognise it -> message)."""

from __future__ import annotations

from ._common import CheckFailed, Mistake, close, launch_reports, name_the_first, passed


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


class _Rank:
    """What rank ``r`` reported (``got``), read against the unsharded embedding (``split``)."""

    def __init__(self, split: _VocabSplit, r: int, got: dict):
        self.split, self.r, self.got = split, r, got
        self.n, self.about = split.n, split.about(r)

    @property
    def weight(self):
        return self.got.get("weight")

    @property
    def expected_rows(self):
        return self.split.rows_of(self.r, self.split.table)

    @property
    def span(self) -> str:
        return "rows {first} to {last}".format(**self.about)

    @property
    def error(self) -> str:
        return self.got.get("error") or ""

    @property
    def y(self):
        return self.got.get("y")

    @property
    def grad(self):
        return self.got.get("grad_weight")

    @property
    def unseen_collectives(self) -> list[str]:
        return [w for w in self.got.get("warnings", []) if _UNSEEN_COLLECTIVE in w]


def _not_zeroed(row: str):
    return lambda k: ("rank {r}'s output is each token's vector plus, from every rank that does not own it, the row "
                      f"that rank looked it up as ({row}): the tokens outside [start, end) were not zeroed. Zero "
                      "their vectors (a mask) before the sum.").format(**k.about)


# Each step's mistakes, read on one rank at a time (readings: the rank's _Rank), in the check's order.
SLICE_MISTAKES = (
    # (vocab, dim / n) is a split of the columns: recognised from the shape alone
    Mistake("sliced along the embedding dimension",
            lambda k: k.weight is not None and k.weight.shape != k.expected_rows.shape
            and k.weight.shape == (k.split.vocab, k.split.dim // k.n),
            lambda k: f"rank {k.r} holds a table of shape {tuple(k.weight.shape)}, expected "
                      f"{tuple(k.expected_rows.shape)}: its slice of the vocabulary, {k.span} of embedding.weight "
                      f"(vocab_size, dim) = {(k.split.vocab, k.split.dim)}, chunk(world_size, dim=0)[rank]. It is a "
                      "slice of the EMBEDDING DIMENSION (the columns), ColwiseParallel's split: the vocabulary is "
                      "the rows, dim 0."),
    Mistake("another slice", lambda k: k.weight is not None and k.weight.shape == k.expected_rows.shape
            and not _same(k.weight, k.expected_rows),
            lambda k: f"rank {k.r}'s table has the right shape but not {k.span} of embedding.weight: take "
                      "chunk(world_size, dim=0)[rank]."),
)
# A lookup outside a rank's slice stops that rank, and the others then fail too, waiting for it.
NOT_SHIFTED = Mistake(
    "token ids not shifted", lambda k: any(w in k.error for w in _INDEX_ERRORS),
    lambda k: ("rank {r} looked up a row its slice does not have ({error}). Its table holds {rows} rows, token ids "
               "{first} to {last}, as rows 0 to {top}: the tokens were not shifted by start, or a token outside "
               "[start, end) was looked up as it is (Hint 1). Rank 0 gets away with a missing shift: its start is "
               "0.").format(error=k.error, top=k.split.rows - 1, **k.about))
# What the worker measured, whatever the layer reports as its weight: the elements of every
# tensor the layer keeps; and the collectives of its forward (CommDebugMode).
TABLE_NOT_SPLIT = Mistake(
    "whole table kept",
    lambda k: k.got.get("held") is not None and k.n > 1 and k.got["held"] > k.split.rows * k.split.dim,
    lambda k: f"rank {k.r}'s layer keeps {k.got['held']} elements in its tensors (parameters, buffers and "
              f"attributes), but its rows of the table are {k.split.rows * k.split.dim}: it holds more of the table "
              "than its own rows, so the table is not split (Hint 1).")
NO_COLLECTIVE = Mistake(
    "table elsewhere", lambda k: k.got.get("forward_collectives") == 0 and k.n > 1,
    lambda k: f"rank {k.r}'s forward ran no collective, yet it returned every token's vector: no rank can know the "
              "vectors of the tokens outside its rows but from the other ranks; it read them from a copy of the "
              "table (Hint 1).")
# The wrong outputs the exercise names, tried in this order on a rank's output of the right shape.
OUTPUT_MISTAKES = (
    Mistake("partial results not summed", lambda k: k.n > 1 and close(k.y, k.split.partial(k.r)),
            lambda k: ("rank {r}'s output holds only the vectors of its own tokens (ids {first} to {last}), zeros for "
                       "the others: the partial results were never summed over the ranks (Hint 1; the given "
                       "Function is in Hint 2).").format(**k.about)),
    Mistake("outside tokens looked up as row 0", lambda k: close(k.y, k.split.sum_if_row_zero()),
            _not_zeroed("its row 0")),
    Mistake("outside tokens clamped into the slice", lambda k: close(k.y, k.split.sum_if_clamped()),
            _not_zeroed("a clamped row")),
)
# A plain dist.all_reduce gives the right output and here, by luck, the right gradient: torch's
# warning is what tells it apart.
PLAIN_ALL_REDUCE = Mistake(
    "plain all_reduce", lambda k: bool(k.unseen_collectives),
    lambda k: f"rank {k.r} sums with a plain dist.all_reduce on a tensor autograd tracks; torch warned: "
              f"{k.unseen_collectives[0][:120]!r}... A dist.* call is invisible to autograd: here the gradient "
              "silently passes through unchanged, right for this sum by luck, and torch deprecates even that (a "
              "future release detaches the output: no gradient would reach the table); the same call elsewhere "
              "gives wrong gradients. The given Function is there for this sum (Hint 1).")
GRADIENT_MISTAKES = (
    Mistake("no gradient reaches the table", lambda k: k.grad is None,
            lambda k: f"rank {k.r}'s table got no gradient: backward never reached it. A dist.all_reduce on a "
                      "detached copy (or under no_grad) cuts the graph; the given Function's backward passes the "
                      "gradient on (Hint 1)."),
    # the sum's backward all-reduced the gradient again
    Mistake("gradient all-reduced again",
            lambda k: k.n > 1 and close(k.grad, k.n * k.split.rows_of(k.r, k.split.grad_weight)),
            lambda k: f"rank {k.r}'s table gradient is exactly world_size = {k.n} times too big: the backward of "
                      "the sum all-reduces the gradient again (torch.distributed.nn.functional.all_reduce does). "
                      "Every rank already holds the whole gradient of the sum: its backward is the identity, as in "
                      "ReduceFromParallel."),
)


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


def _ranks(results: dict, split: _VocabSplit) -> list[_Rank]:
    return [_Rank(split, r, results[r]) for r in range(split.n)]


def _check_written(results: dict, split: _VocabSplit) -> None:
    """No rank stopped at the exercise's `raise NotImplementedError`."""
    for r, error in _errors(results, split.n).items():
        if error.startswith("NotImplementedError"):
            where = results[r].get("where") or "__init__ or forward"
            raise split.fail(f"VocabParallelEmbedding.{where} still raises NotImplementedError "
                             f"(rank {r}): write it.")


def _check_slices(results: dict, split: _VocabSplit) -> None:
    """Each rank's slice of the table, as far as __init__ got: rows start..end-1."""
    for k in _ranks(results, split):
        name_the_first(SLICE_MISTAKES, k, before=f"{split.name}: ")
        if k.weight is not None and k.weight.shape != k.expected_rows.shape:
            raise split.fail(f"rank {k.r} holds a table of shape {tuple(k.weight.shape)}, expected "
                             f"{tuple(k.expected_rows.shape)}: its slice of the vocabulary, {k.span} of "
                             f"embedding.weight (vocab_size, dim) = {(split.vocab, split.dim)}, "
                             "chunk(world_size, dim=0)[rank].")


def _check_no_error(results: dict, split: _VocabSplit) -> None:
    """A rank that raised, told by its first cause."""
    errors = _errors(results, split.n)
    if not errors:
        return
    for k in _ranks(results, split):
        name_the_first((NOT_SHIFTED,), k, before=f"{split.name}: ")
    r, error = next(iter(errors.items()))
    where = results[r].get("where")
    raise split.fail(f"rank {r} raised {error}" + (f" in VocabParallelEmbedding.{where}" if where else "")
                     + " (see its traceback above).")


def _check_each_rank(results: dict, split: _VocabSplit, mistakes) -> None:
    for k in _ranks(results, split):
        name_the_first(mistakes, k, before=f"{split.name}: ")


def _check_outputs(results: dict, split: _VocabSplit) -> None:
    """Every rank returns nn.Embedding's output, exactly; else the first named mistake it shows."""
    for k in _ranks(results, split):
        if k.y is None:
            raise split.fail(f"rank {k.r} reported no output: did forward return one?")
        if _same(k.y, split.y):
            continue
        if k.y.shape != split.y.shape:
            raise split.fail(f"rank {k.r}'s output has shape {tuple(k.y.shape)}, expected "
                             f"{tuple(split.y.shape)} (the tokens' shape, then the embedding dimension).")
        name_the_first(OUTPUT_MISTAKES, k, before=f"{split.name}: ")
        raise split.fail(f"rank {k.r}'s output differs from nn.Embedding's ({_gap(k.y, split.y)}): check "
                         "which row each token is looked up as (global id - start) and that the others "
                         "are zeroed.")


def _check_gradients(results: dict, split: _VocabSplit) -> None:
    """Every rank gets its rows of the table's gradient, exactly."""
    for k in _ranks(results, split):
        expected = split.rows_of(k.r, split.grad_weight)
        if k.grad is not None and _same(k.grad, expected):
            continue
        name_the_first(GRADIENT_MISTAKES, k, before=f"{split.name}: ")
        raise split.fail(f"rank {k.r}'s table gradient is wrong ({_gap(k.grad, expected)}); each row "
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
    _check_each_rank(results, split, (TABLE_NOT_SPLIT,))
    _check_outputs(results, split)
    _check_each_rank(results, split, (NO_COLLECTIVE,))
    _check_each_rank(results, split, (PLAIN_ALL_REDUCE,))
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


class _PlanStyles:
    """The styles a plan gives the modules of layers.0 and the output (readings of PLAN_MISTAKES)."""

    def __init__(self, plan: dict):
        self.plan = plan

    def kind(self, target):
        style = _style_of(self.plan, target)
        return style and style["style"]

    def columns(self, region) -> list:
        return [self.kind(f"layers.0.{region}.{c}") for c in _REGIONS[region][0]]

    def row(self, region):
        return self.kind(f"layers.0.{region}.{_REGIONS[region][1]}")


# Each region's column layers, its row layer, and what its column layers split.
_REGIONS = {"feed_forward": (("w1", "w3"), "w2", "hidden units"), "attention": (("wq", "wk", "wv"), "wo", "heads")}


def _both_columns(region) -> Mistake:
    columns, row, features = _REGIONS[region]
    return Mistake(f"{region} both colwise",
                   lambda p: p.row(region) == "ColwiseParallel" and "ColwiseParallel" in p.columns(region),
                   f"{region}.{row} is ColwiseParallel like {', '.join(columns)}. A column layer's output is its "
                   f"slice of the features ({region}'s {features}): the layer after it must take that slice as "
                   "input and sum the partial results, RowwiseParallel.")


def _row_then_column(region) -> Mistake:
    columns, row, _ = _REGIONS[region]
    return Mistake(f"{region} row then column",
                   lambda p: p.row(region) == "ColwiseParallel" and "RowwiseParallel" in p.columns(region),
                   f"{region}: {', '.join(columns)} are RowwiseParallel and {row} ColwiseParallel, the wrong way "
                   "round. The first layers take the whole (replicated) input and split the output features "
                   f"(ColwiseParallel); {row} takes those slices and all-reduces (RowwiseParallel).")


# The classic plan mistakes, read from the styles the plan gave: the cause that comes first in
# every message, the numbers only its symptom.
PLAN_MISTAKES = (
    _both_columns("feed_forward"), _row_then_column("feed_forward"),
    _both_columns("attention"), _row_then_column("attention"),
    Mistake("logits not replicated",
            lambda p: bool(_style_of(p.plan, "output"))
            and "Replicate" not in _style_of(p.plan, "output")["output_layouts"],
            "output is ColwiseParallel without output_layouts=Replicate(): each rank gets only its vocabulary "
            "slice of the logits, and the loss needs all of them."),
)


def _named_plan_mistake(plan: dict) -> Mistake | None:
    """The first classic plan mistake the plan's styles show, or None."""
    styles = _PlanStyles(plan)
    return next((mistake for mistake in PLAN_MISTAKES if mistake.seen(styles)), None)


def _failed(where: str, named: Mistake | None, symptom: str, after: str = "") -> CheckFailed:
    """A failure of the sharded model's numbers: the named plan mistake as its cause, if any."""
    if named is None:
        return CheckFailed(where + symptom + after)
    return CheckFailed(where + named.text() + after, mistake=named.name)


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


def _check_ran(got: dict, where: str, named: Mistake | None) -> None:
    if got["error"]:
        if "NotImplementedError" in got["error"]:
            raise CheckFailed("parallelize() still raises NotImplementedError: write the plan.")
        raise _failed(where, named, "the sharded model failed", f"\n(it raised {got['error']})")


def _check_numbers(got: dict, where: str, named: Mistake | None, unsharded, logits, rtol: float,
                   atol: float) -> None:
    """Logits and every gradient against the unsharded model's; a named plan mistake says why."""
    import torch

    y = got["logits"]
    if y.shape != logits.shape:
        raise _failed(where, named, f"the logits have shape {tuple(y.shape)}, expected {tuple(logits.shape)}: "
                                    "every rank must see all of them (output_layouts=Replicate()).")
    if not torch.allclose(y.double(), logits.detach(), rtol=rtol, atol=atol):
        gap = (y.double() - logits.detach()).abs().max().item()
        raise _failed(where, named, "the logits differ from the unsharded model's", f" (largest difference {gap:.3g})")
    for name, param in unsharded.named_parameters():
        grad = got["grads"].get(name)
        if grad is None or not torch.allclose(grad.double(), param.grad, rtol=rtol, atol=atol):
            differs = f"the gradient of {name} differs from the unsharded model's"
            raise _failed(where + differs + ": " if named else where, named, differs + ".")


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
    name_the_first((WEIGHT_LEFT_WHOLE,), [n for n in must_shard if "Shard" not in placements.get(n, "")])
    return len(must_shard)


WEIGHT_LEFT_WHOLE = Mistake(
    "a weight left whole", lambda plain: bool(plain),
    lambda plain: f"{len(plain)} weight{'s are' if len(plain) > 1 else ' is'} not sharded, e.g. {plain[0]}: every "
                  "rank holds all of it. Tensor parallel splits every linear layer and the token embedding "
                  "(RowwiseParallel(input_layouts=Replicate()) splits the vocabulary).")


def _unshared_inputs(comm: dict, fqn: str) -> list[str]:
    """The regions of layer ``fqn`` whose column layers each all-reduced their own input gradient."""
    return [f"{region} all-reduces {columns} input gradients in backward, one per column layer"
            for region, columns in _COLUMN_LAYERS.items()
            if comm.get(f"{fqn}.{region}", {}).get("backward", {}).get("all_reduce", 0) == columns]


# A layer with other collectives than Megatron's (readings: CommDebugMode's counts, the layer).
INPUT_NOT_SHARED = Mistake(
    "a region's input not shared", lambda comm, fqn: bool(_unshared_inputs(comm, fqn)),
    lambda comm, fqn: "; ".join(_unshared_inputs(comm, fqn)) + ". Give the module one shared replicated input: "
                      "PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), "
                      "use_local_output=False) on it, so its input gradient is all-reduced once.")


def _check_collectives(comm: dict, n_layers: int) -> None:
    """Megatron's two all-reduces per layer in forward and two in backward (CommDebugMode's counts)."""
    for layer in range(n_layers):
        fqn = f"TinyTransformer.layers.{layer}"
        counts = comm.get(fqn, {"forward": {}, "backward": {}})
        if counts != _PER_LAYER:
            does = (f"layers.{layer} does forward {counts['forward']} and backward {counts['backward']}, expected "
                    f"{_PER_LAYER['forward']} and {_PER_LAYER['backward']}: ")
            name_the_first((INPUT_NOT_SHARED,), comm, fqn, before=does)
            raise CheckFailed(does + " Megatron's layer needs one all-reduce after attention and one after the MLP, "
                              "in forward and in backward.")


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
