"""Chapter 16.5's check passes on the solution and names each mistake planted in a copy of it.

The answer is ReadyBlock, the solution cell's class; each test changes one piece of it and calls
the check in this process (Dynamo only, with the check's counting backend: no compiler runs and
no process starts)."""

import pytest
import torch

from spike_course import models
from spike_course.checks import CheckFailed, Tampering, ch16_compile_ready, check_compile_ready_block
from named import mistake_of, names
from planting import answer_function, solution_cell

SOLUTION = solution_cell("16_what_large_jobs_run_today", "ReadyBlock")
SELECT = "update = torch.where(peak > self.limit, update * (self.limit / peak), update)"
SCALE = 'self.register_buffer("scale", torch.tensor((depth + 1) ** -0.5), persistent=False)'


def planted(*changes):
    """ReadyBlock of the solution with each (old, new) of ``changes`` made."""
    source = SOLUTION
    for old, new in changes:
        assert old in source, f"the solution no longer contains {old!r}: update this test"
        source = source.replace(old, new, 1)
    return answer_function(source, "ReadyBlock", namespace={"torch": torch, "ClippedBlock": models.ClippedBlock})


def test_solution_passes(capsys):
    check_compile_ready_block(planted())
    assert "check passed" in capsys.readouterr().out


def test_the_check_s_batches_stay_within_the_limit_and_exceed_it_in_every_block():
    """What names 'within the limit scaled' and 'over the limit changed' apart: the calm batch
    never takes the original's branch, the spiky one takes it in every block."""
    blocks = ch16_compile_ready._stack(models.ClippedBlock, ch16_compile_ready.SETTING.seed)
    for kind, x in ch16_compile_ready._batches().items():
        peaks = []
        for block in blocks:
            peaks.append(block.down(torch.relu(block.up(x))).abs().amax().item())
            x = block(x)
        assert all(peak <= block.limit for peak in peaks) if kind == "calm" else min(peaks) > block.limit, peaks


FORWARD_END = "return x + update * self.scale"
PLANTS = {  # a mistake (its name, and what tells the plant apart) -> (changes, what the message says)
    "a graph break": ([(SELECT, "if peak > self.limit:\n            update = update * (self.limit / peak)")],
                      "Data-dependent branching"),
    "nothing captured": ([("    def forward(self, x):", "    @torch.compiler.disable\n    def forward(self, x):")],
                         "captured no graph"),
    "a graph per block": ([(FORWARD_END, "return x + update * (self.depth + 1) ** -0.5")],
                          r"8 graphs for 8 blocks.*depth is \[0, 1, 2, 3, 4, 5, 6, 7\]"),
    "an update within the limit scaled": ([(SELECT, "update = update * (self.limit / peak)")], "the calm batch"),
    "an update over the limit changed": ([(SELECT, "update = update")], "the spiky batch"),
    "other bits (a division by the square root)": ([(SCALE, SCALE.replace("** -0.5", "** 0.5")),
                                                    (FORWARD_END, "return x + update / self.scale")], "on both batches"),
    "other bits (the power in float32)": ([("torch.tensor((depth + 1) ** -0.5)", "torch.tensor(depth + 1.0) ** -0.5")],
                                          "on both batches"),
}
CHECK_MODULE = ch16_compile_ready  # tests/named.py


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_each_mistake_is_named(name):
    changes, message = PLANTS[name]
    with names(mistake_of(name), says=message):
        check_compile_ready_block(planted(*changes))


def test_the_original_block_itself_breaks_the_graph():
    """A copy of what the exercise gives: ClippedBlock as it is."""
    with names("a graph break", says="Data-dependent branching"):
        check_compile_ready_block(models.ClippedBlock)


def test_a_branch_hidden_from_dynamo_is_a_graph_break():
    """The original's branch inside an allow_in_graph function: Dynamo records the call without
    looking inside, and AOTAutograd's trace (Inductor's input) meets the branch: named."""
    @torch._dynamo.allow_in_graph
    def scaled(update, limit):
        peak = update.abs().amax()
        if peak > limit:
            update = update * (limit / peak)
        return update

    answer = planted()

    class ReadyBlock(answer):
        def forward(self, x):
            return x + scaled(self.down(torch.relu(self.up(x))), self.limit) * self.scale

    with names("a graph break", says="data-dependent"):
        check_compile_ready_block(ReadyBlock)


def test_the_blank_is_named():
    class ReadyBlock(models.ClippedBlock):
        def forward(self, x):
            raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_compile_ready_block(ReadyBlock)


def test_a_block_with_other_weights_is_refused_with_its_reason():
    class ReadyBlock(models.ClippedBlock):
        def __init__(self, dim, depth, limit=1.0):
            super().__init__(dim, depth, limit)
            self.gain = torch.nn.Parameter(torch.ones(()))

    with pytest.raises(CheckFailed, match="keep its weights") as failure:
        check_compile_ready_block(ReadyBlock)
    assert failure.value.mistake is None


def test_an_answer_that_rebinds_the_original_s_forward_is_named(monkeypatch):
    """An answer that never scales its update, and makes the original do the same, so that the
    two agree: the guard names the rebinding before "check passed"."""
    answer = planted((SELECT, "update = update"))

    def never_scaled(self, x):
        return x + self.down(torch.relu(self.up(x))) * (self.depth + 1) ** -0.5

    class ReadyBlock(answer):
        def __init__(self, dim, depth, limit=1.0):
            monkeypatch.setattr(models.ClippedBlock, "forward", never_scaled)
            super().__init__(dim, depth, limit)

    with pytest.raises(Tampering, match="ClippedBlock.forward"):
        check_compile_ready_block(ReadyBlock)


def test_an_answer_that_rebinds_torch_compile_is_named(monkeypatch):
    """torch.compile replaced by one that runs the answer eagerly: no graph, no break to see."""
    original = models.ClippedBlock

    class ReadyBlock(original):
        def __init__(self, dim, depth, limit=1.0):
            monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
            super().__init__(dim, depth, limit)

    with pytest.raises(Tampering, match="torch.compile"):
        check_compile_ready_block(ReadyBlock)


def test_hint_3_s_numbers_hold_in_the_pinned_torch():
    """A float32 tensor times a Python float equals it times that float as a float32 tensor; the
    power computed in float32 rounds otherwise at depths 5 and 6 of the check's 0 to 7."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    for depth in range(ch16_compile_ready.SETTING.blocks):
        assert torch.equal(x * (depth + 1) ** -0.5, x * torch.tensor((depth + 1) ** -0.5))
    rounded_otherwise = [depth for depth in range(ch16_compile_ready.SETTING.blocks)
                         if not torch.equal(torch.tensor((depth + 1) ** -0.5), torch.tensor(depth + 1.0) ** -0.5)]
    assert rounded_otherwise == [5, 6]
