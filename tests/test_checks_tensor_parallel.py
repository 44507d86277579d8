"""Chapter 05, exercise 1: check_vocab_parallel_embedding passes the solution's layer and
names each classic mistake.

Every mistake is planted in a copy of the solution's vocab_parallel.py (a solution region
replaced), written next to the exercise's own check_embedding.py and run on 2 ranks: one
launch per mistake, 3-5 seconds each. The reference is the solution notebook's own
``unsharded_reference``. A few cases that need no launch use reported results made here.
"""

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import spike_course
from spike_course.course import conventions, workers
from spike_course.checks import CheckFailed, check_vocab_parallel_embedding, ch05_tensor_parallel as tensor_parallel
from spike_course.course.conventions import region_matches, regions, written_file
from named import names
from planting import replace_region

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "05_tensor_parallel"
NOTEBOOK = course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb")
CHECK_SCRIPT = workers.worker_cells(NOTEBOOK)[f"{STEM}/check_embedding.py"]
LAYER = written_file(NOTEBOOK, f"workers/{STEM}/vocab_parallel.py")
_namespace = {"torch": torch, "nn": nn}
exec(next(c.source for c in NOTEBOOK.cells if c.source.startswith("def unsharded_reference")), _namespace)
unsharded_reference = _namespace["unsharded_reference"]

# the solution's forward region, dedented, without its marker lines
FORWARD = textwrap.dedent(regions(LAYER)[1])


def forward_with(old, new):
    """The solution's forward region with ``old`` replaced by ``new``."""
    assert old in FORWARD, f"the solution's forward no longer contains {old!r}: update this test"
    return FORWARD.replace(old, new, 1)


def plant(init=None, forward=None):
    """The solution's file with its __init__ and/or forward region replaced (None: kept)."""
    assert len(region_matches(LAYER)) == 2, "the solution's vocab_parallel.py no longer has 2 solution regions"
    planted = LAYER
    for number, new in reversed(list(enumerate([init, forward]))):  # the last first: the spans stay put
        if new is not None:
            planted = replace_region(planted, number, textwrap.indent(new, region_matches(planted)[number].group(1)))
    return planted


MISTAKES = {
    "blank": (None, r"VocabParallelEmbedding.__init__ still raises NotImplementedError"),
    "not_zeroed": (dict(forward=forward_with(".masked_fill(outside.unsqueeze(-1), 0.0)", "")),
                   r"its row 0.*the tokens outside \[start, end\) were not zeroed"),
    "not_shifted": (dict(forward=forward_with("(tokens - self.start)", "tokens")),
                    r"rank 1 looked up a row its slice does not have \(IndexError.*not shifted by start"),
    "sliced_along_embedding_dim": (dict(init="""\
self.weight = nn.Parameter(embedding.weight.detach().chunk(world, dim=1)[rank].clone())
self.start = rank * embedding.num_embeddings // world
self.end = self.start + embedding.num_embeddings // world
"""), r"rank 0 holds a table of shape \(16, 4\), expected \(8, 8\).*EMBEDDING DIMENSION"),
    "not_summed": (dict(forward=forward_with("return ReduceFromParallel.apply(partial, self.group)",
                                               "return partial")),
                   r"only the vectors of its own tokens.*never summed over the ranks \(Hint 1"),
    "plain_all_reduce": (dict(forward=forward_with(
        "return ReduceFromParallel.apply(partial, self.group)",
        "dist.all_reduce(partial, group=self.group)\nreturn partial")),
        r"plain dist.all_reduce on a tensor autograd tracks.*The given Function is there for this sum"),
    "differentiable_all_reduce": (dict(forward=forward_with(
        "return ReduceFromParallel.apply(partial, self.group)",
        "from torch.distributed.nn.functional import all_reduce\nreturn all_reduce(partial)")),
        r"world_size = 2 times too big.*identity"),
    # Two trivial passes of issue 40's audit: the whole table kept beside the slice (a buffer),
    # or out of the layer's reach (a module global); the output looked up there, no collective.
    "whole_table_kept": (dict(
        init="self.weight = nn.Parameter(embedding.weight.detach().chunk(world, dim=0)[rank].clone())\n"
             "self.start, self.end = rank * self.weight.shape[0], (rank + 1) * self.weight.shape[0]\n"
             "self.register_buffer('table', embedding.weight.detach().clone())\n",
        forward="rows = [self.table[:self.start], self.weight, self.table[self.end:]]\n"
                "return F.embedding(tokens, torch.cat(rows))\n"),
        r"rank 0's layer keeps 192 elements.*its rows of the table are 64"),
    "table_elsewhere": (dict(
        init="self.weight = nn.Parameter(embedding.weight.detach().chunk(world, dim=0)[rank].clone())\n"
             "self.start, self.end = rank * self.weight.shape[0], (rank + 1) * self.weight.shape[0]\n"
             "torch.whole_table = embedding.weight.detach().clone()\n",
        forward="rows = [torch.whole_table[:self.start], self.weight, torch.whole_table[self.end:]]\n"
                "return F.embedding(tokens, torch.cat(rows))\n"),
        r"rank 0's forward ran no collective, yet it returned every token's vector"),
}


# The plants of the check's tables (tests/named.py), by the mistake each is named as.
PLANTED_MISTAKE = {"not_zeroed": "outside tokens looked up as row 0",
                   "not_shifted": "token ids not shifted",
                   "sliced_along_embedding_dim": "sliced along the embedding dimension",
                   "not_summed": "partial results not summed", "plain_all_reduce": "plain all_reduce",
                   "differentiable_all_reduce": "gradient all-reduced again", "whole_table_kept": "whole table kept",
                   "table_elsewhere": "table elsewhere"}


def run(worker, layer_source):
    """Launch the exercise's check script on 2 ranks next to ``layer_source``; the reference."""
    worker(layer_source, "vocab_parallel.py")
    result = spike_course.launch(worker(CHECK_SCRIPT, "check_embedding.py"), nproc=2, echo=False,
                                 progress=False, timeout=120, check=False)
    return result, unsharded_reference(result.reports[0]["problem"])


@pytest.mark.processes
def test_the_solution_passes(worker, no_orphans, capsys):
    result, reference = run(worker, LAYER)
    assert result.ok
    check_vocab_parallel_embedding(result.reports, reference)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_planted_mistake_is_named(mistake, worker, no_orphans):
    regions, message = MISTAKES[mistake]
    source = conventions.blank_source(LAYER) if regions is None else plant(**regions)
    result, reference = run(worker, source)
    with names(PLANTED_MISTAKE.get(mistake), says=message):
        check_vocab_parallel_embedding(result.reports, reference)


# --- without a launch: what ranks of a right layer report, changed by hand ---

def reported(n):
    """A problem like check_embedding.py's and what n ranks of a right layer report."""
    torch.manual_seed(0)
    weight = torch.randn(16, 8)
    tokens = torch.cat([torch.randperm(16), torch.randperm(16)[:8]]).view(3, 8)
    reference = unsharded_reference({"weight": weight, "tokens": tokens, "grad_out": torch.randn(3, 8, 8)})
    results = {r: {"world": n, "weight": weight.chunk(n)[r].clone(), "y": reference["y"].clone(),
                   "grad_weight": reference["grad_weight"].chunk(n)[r].clone(), "warnings": []}
               for r in range(n)}
    return results, reference


@pytest.mark.parametrize("n", [1, 2, 4])
def test_right_answers_pass(n, capsys):
    check_vocab_parallel_embedding(*reported(n))
    assert f"on {n} ranks" in capsys.readouterr().out


def _no_gradient(results, reference):
    results[2]["grad_weight"] = None  # dist.all_reduce on a detached copy: right output, no gradient at all


def _another_slice(results, reference):
    results[1]["weight"] = results[0]["weight"].clone()  # rank 0's rows on rank 1 too


def _clamped(results, reference):
    """Every rank clamps the ids into its slice and does not zero the others: the sum of each
    rank's clamped lookup."""
    rows = 16 // 4
    table, tokens = reference["weight"], reference["tokens"]
    y = sum(table[q * rows:(q + 1) * rows][(tokens - q * rows).clamp(0, rows - 1)] for q in range(4))
    for r in results:
        results[r]["y"] = y.clone()


# Mistakes reported by hand on 4 ranks (no launch): the change to a right layer's reports.
REPORTED = {"no gradient reaches the table": (_no_gradient, "rank 2's table got no gradient.*detached copy"),
            "another slice": (_another_slice, "rank 1's table has the right shape but not rows 4 to 7"),
            "outside tokens clamped into the slice": (_clamped, r"\(a clamped row\)")}
CHECK_MODULE = tensor_parallel  # tests/named.py
PLANTS = {**{name: key for key, name in PLANTED_MISTAKE.items()}, **REPORTED}


@pytest.mark.parametrize("name", REPORTED)
def test_a_mistake_reported_by_hand_is_named(name):
    results, reference = reported(4)
    change, says = REPORTED[name]
    change(results, reference)
    with names(name, says=says):
        check_vocab_parallel_embedding(results, reference)


def test_a_rank_that_reported_nothing_is_named():
    results, reference = reported(2)
    del results[1]
    with pytest.raises(CheckFailed, match=r"ranks \[1\] of 2 reported nothing"):
        check_vocab_parallel_embedding(results, reference)
