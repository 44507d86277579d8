"""Exercise check for chapter 16.5: a block made ready for ``torch.compile``.

``check_compile_ready_block(answer)`` builds BLOCKS blocks of the answer's class and of
``models.ClippedBlock``, with the same weights, and compiles each answer block's ``forward`` with
``fullgraph=True``, as 16.5 compiled FSDP2's blocks (their hooks outside), and with a backend of
the check's own: it counts the graphs Dynamo hands it and runs them as AOTAutograd traces them
for Inductor, forward and backward (torch's ``aot_eager``: no compiler, so the operations are
eager's and so are the bits). Both stacks run on two batches the check draws: a calm one, whose
updates stay within the limit in every block, and a spiky one, whose updates exceed it in every
block. The answer must break no graph, compile
one graph for all blocks and both batches, and give the original's outputs, input gradients and
weight gradients bit for bit.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from ..models import ClippedBlock  # imported with the checks: the guard's snapshot holds its forward
from ._common import CheckFailed, Mistake, name_the_first, passed


class Setting(NamedTuple):
    """The stack and the batches, in a tuple the guard (``_guard``) watches."""
    blocks: int = 8  # depths 0 to 7: a scale computed in float32 rounds otherwise at depths 5 and 6
    dim: int = 16
    tokens: int = 8
    calm: float = 0.3  # the batches' scales: updates of at most about 0.25, within the limit of 1
    spiky: float = 3.0  # ...and of 2 to 3, over it, in every block
    seed: int = 1605


SETTING = Setting()
BLANK = "your block still raises NotImplementedError: write it first."


class Run(NamedTuple):
    """What one batch gave through a stack: the output, the input's gradient, the weights'."""
    output: object
    input_grad: object
    weight_grads: tuple


class Readings(NamedTuple):
    """What the check saw of the answer: Dynamo's error (None if it captured without one), the
    graphs its backend received, the blocks' Python numbers that differ, and per batch whether
    the answer's run equals the original's bit for bit, with the largest difference."""
    error: object
    graphs: int
    differing: dict
    equal: dict
    difference: dict


def _stack(cls, generator_seed: int) -> list:
    import torch

    torch.manual_seed(generator_seed)
    return [cls(SETTING.dim, depth) for depth in range(SETTING.blocks)]


def _answer_blocks(answer, originals) -> list:
    """The answer's blocks, each with its original's weights (a copy)."""
    import torch

    try:
        blocks = [answer(SETTING.dim, depth) for depth in range(SETTING.blocks)]
    except NotImplementedError:
        raise CheckFailed(BLANK) from None
    except TypeError as error:
        raise CheckFailed(f"{answer.__name__}(dim, depth) failed ({error}): keep ClippedBlock's constructor, "
                          "as a subclass does that calls super().__init__(dim, depth, limit).") from None
    for block, original in zip(blocks, originals):
        theirs, ours = dict(block.named_parameters()), dict(original.named_parameters())
        if {name: p.shape for name, p in theirs.items()} != {name: p.shape for name, p in ours.items()}:
            raise CheckFailed(f"your block's parameters are {sorted(theirs)}, ClippedBlock's {sorted(ours)}: "
                              "keep its weights (up and down) and add none; a number the block needs may be a "
                              "buffer.")
        with torch.no_grad():
            for name, p in ours.items():
                theirs[name].copy_(p)
    return blocks


def _batches() -> dict:
    import torch

    generator = torch.Generator().manual_seed(SETTING.seed)
    return {kind: torch.randn(SETTING.tokens, SETTING.dim, generator=generator) * scale
            for kind, scale in (("calm", SETTING.calm), ("spiky", SETTING.spiky))}


def _run(forwards, parameters, batch, cotangent) -> Run:
    """The batch through ``forwards`` (one a block), then the backward of ``output . cotangent``.
    The batch requires a gradient, like every later block's input: all blocks see one kind of input."""
    x = batch.clone().requires_grad_()
    y = x
    for forward in forwards:
        y = forward(y)
    y.backward(cotangent)
    grads = tuple(p.grad.clone() if p.grad is not None else None for p in parameters)
    for p in parameters:
        p.grad = None
    return Run(y.detach(), x.grad, grads)


def _equal(a: Run, b: Run) -> bool:
    import torch

    tensors = [(a.output, b.output), (a.input_grad, b.input_grad), *zip(a.weight_grads, b.weight_grads)]
    return all(x is not None and y is not None and torch.equal(x, y) for x, y in tensors)


def _largest_difference(a: Run, b: Run) -> float:
    if a.output.shape != b.output.shape:
        return float("inf")
    return (a.output.double() - b.output.double()).abs().max().item()


def _differing_numbers(blocks) -> dict:
    """The blocks' plain Python numbers whose values differ from block to block, by name."""
    numbers = [{k: v for k, v in vars(b).items() if type(v) in (int, float, bool)} for b in blocks]
    return {name: [n.get(name) for n in numbers] for name in numbers[0]
            if len({repr(n.get(name)) for n in numbers}) > 1}


def readings_of(answer) -> Readings:
    import torch

    from ._guard import verify

    compile_ = torch.compile  # taken before any of the answer's code runs
    originals = _stack(ClippedBlock, SETTING.seed)
    blocks = _answer_blocks(answer, originals)
    batches = _batches()
    _run_eagerly(blocks, batches["calm"])
    graphs = []
    # torch's "aot_eager" backend: AOTAutograd traces each graph Dynamo captured, with its
    # backward, into torch's operators, as it does for Inductor, and runs them as traced. A
    # branch hidden from Dynamo (inside an allow_in_graph function) fails here, as under Inductor.
    traced = torch._dynamo.lookup_backend("aot_eager")

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return traced(graph_module, example_inputs)

    torch._dynamo.reset()  # graphs compiled earlier in this kernel are not the answer's
    compiled = [compile_(block.forward, backend=counting_backend, fullgraph=True) for block in blocks]
    cotangent = torch.randn(SETTING.tokens, SETTING.dim, generator=torch.Generator().manual_seed(SETTING.seed + 1))
    ours = [p for b in originals for p in b.parameters()]
    theirs = [p for b in blocks for p in b.parameters()]
    equal, difference, error = {}, {}, None
    for kind, batch in batches.items():
        expected = _run(originals, ours, batch, cotangent)
        try:
            got = _run(compiled, theirs, batch, cotangent)
        except torch._dynamo.exc.TorchDynamoException as stopped:
            error = stopped
            break
        except Exception as crashed:
            raise CheckFailed(f"your block raised {type(crashed).__name__} when compiled: {crashed}") from None
        equal[kind], difference[kind] = _equal(expected, got), _largest_difference(expected, got)
    torch._dynamo.reset()
    verify()  # the answer's code has run: what the check judges with must be what it was
    return Readings(error, len(graphs), _differing_numbers(blocks), equal, difference)


def _run_eagerly(blocks, batch) -> None:
    """The answer's blocks on a batch, uncompiled: a blank or a crash is named as such, before
    Dynamo wraps it in its own error."""
    import torch

    x = batch.clone().requires_grad_()
    try:
        for block in blocks:
            x = block(x)
    except NotImplementedError:
        raise CheckFailed(BLANK) from None
    except Exception as error:
        raise CheckFailed(f"your block raised {type(error).__name__} when run eagerly: {error}. Run it on a "
                          "batch uncompiled first.") from None
    if not isinstance(x, torch.Tensor) or not x.requires_grad or x.shape != batch.shape:
        raise CheckFailed("your block's forward must return a tensor of its input's shape that depends on "
                          "its input, as ClippedBlock's does.")


def _where(error) -> str:
    """Dynamo's reason (its first line) and the line of the answer it stopped at, where the
    source is known (the innermost frame outside torch)."""
    text = str(error)
    reason = text.strip().splitlines()[0]
    stack = text.split("from user code:")[-1] if "from user code:" in text else ""
    frames = re.findall(r'File "([^"]+)", line \d+, in \w+\n +(\S[^\n]*)', stack)
    ours = [code for file, code in frames if f"{os.sep}torch{os.sep}" not in file]
    return f"{reason} at `{ours[-1].strip()}`" if ours else reason


def _one_graph_each_message(r: Readings) -> str:
    numbers = "; ".join(f"{name} is {values}" for name, values in r.differing.items())
    why = (f" Your blocks differ in plain Python numbers ({numbers}): Dynamo writes such a number into the "
           "graph as a constant and guards on it, so a block with another value compiles again."
           if r.differing else "")
    return (f"Dynamo compiled {r.graphs} graphs for {SETTING.blocks} blocks and two batches of one shape: each "
            f"block should reuse the first block's graph.{why} How can a block carry its own number into a graph "
            "that all blocks share? (Hint 2)")


def _excluded(r: Readings) -> bool:
    """The forward kept out of Dynamo's reach: under torch.compiler.disable (fullgraph then stops
    at it), or with no tensor operation for Dynamo to capture."""
    return (r.error is not None and "compiler.disable" in str(r.error)) or (r.error is None and r.graphs == 0)


MISTAKES = (
    Mistake("nothing captured", _excluded,
            "Dynamo captured no graph of your block's forward: it runs eagerly (under torch.compiler.disable, "
            "or without a tensor operation for Dynamo to record), as Module.compile() ran at FSDP2's hooks in "
            "16.5. The exercise is a forward that Dynamo captures whole."),
    Mistake("a graph break", lambda r: r.error is not None,
            lambda r: f"compiling your block's forward with fullgraph=True stopped: {_where(r.error)}. Without "
            "fullgraph, Dynamo would end the graph there, run that line eagerly and start another graph after "
            "it. What does that line need that a graph cannot hold, and how could the graph compute the same "
            "result without it? (Hint 1)"),
    Mistake("a graph per block", lambda r: r.graphs > 1, _one_graph_each_message),
    Mistake("an update within the limit scaled", lambda r: r.equal["spiky"] and not r.equal["calm"],
            lambda r: "where no update exceeds the limit (the calm batch), your blocks give other results than "
            f"the original (by up to {r.difference['calm']:.3g}), and where every update exceeds it they are "
            "equal: the original leaves an update within the limit as it is. (Hint 1)"),
    Mistake("an update over the limit changed", lambda r: r.equal["calm"] and not r.equal["spiky"],
            lambda r: "where every update exceeds the limit (the spiky batch), your blocks give other results "
            f"than the original (by up to {r.difference['spiky']:.3g}), and within the limit they are equal: "
            "the original scales such an update by limit / peak, as it is. (Hint 1)"),
    Mistake("other bits", lambda r: not (r.equal["calm"] and r.equal["spiky"]),
            lambda r: f"your blocks' results differ from the original's on both batches (by up to "
            f"{max(r.difference.values()):.3g}): the same formula computed with other float operations (a "
            "division for a multiplication, a power computed in float32 where the original computes it in "
            "Python's double) gives other bits, and a compiled model is only comparable with eager when its "
            "operations are eager's. (Hint 3)"),
)


def check_compile_ready_block(answer) -> None:
    """``answer(dim, depth)`` builds a block that computes what ``models.ClippedBlock`` computes."""
    readings = readings_of(answer)
    name_the_first(MISTAKES, readings)
    passed(f"{SETTING.blocks} blocks compiled with fullgraph=True into one graph that they all share, no "
           "graph break, and on a batch within the limit and one over it the outputs and every gradient "
           "equal the eager original's bit for bit")
