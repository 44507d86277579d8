"""Every tensor a worker hands to a collective lives on the rank's device.

Under gloo on a laptop a CPU tensor works anywhere, so a run cannot show the mistake; under
NCCL on a GPU node the same line fails (chapter 00's crash.py did). So the exported workers
are read against a rule: a tensor made by a torch factory (``torch.ones``, ``torch.tensor``,
...) without ``device=``, directly or through a name assigned once in the same function,
must not reach a collective (``dist.all_reduce``, ``broadcast``, ``send``, ...).
"""

import ast

import pytest

from spike_course.course import workers
from tests.test_cluster_workers import ROOT

FACTORIES = {"ones", "zeros", "tensor", "full", "empty", "randn", "rand", "arange", "as_tensor",
             "ones_like", "zeros_like", "full_like", "empty_like", "stack", "cat"}
COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "gather", "scatter"}


def _is_cpu_factory(node) -> bool:
    """torch.ones(...) and kin without device=; a *_like or stack/cat takes its inputs' device."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
        return False
    name = node.func.attr
    if name not in FACTORIES or name.endswith("_like") or name in ("stack", "cat"):
        return False
    return not any(k.arg == "device" for k in node.keywords)


def misplaced_tensors(source: str) -> list[str]:
    """Lines where a collective receives a tensor made on the CPU whatever the rank's device."""
    found = []
    for scope in [n for n in ast.walk(ast.parse(source))
                  if isinstance(n, (ast.Module, ast.FunctionDef))]:
        cpu_names = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and _is_cpu_factory(n.value)
                     for t in n.targets if isinstance(t, ast.Name)}
        for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
            func = call.func
            if not (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES and call.args):
                continue
            tensor = call.args[0]
            if _is_cpu_factory(tensor) or isinstance(tensor, ast.Name) and tensor.id in cpu_names:
                found.append(f"line {call.lineno}: {ast.unparse(call)}")
    return sorted(set(found))


def test_the_rule_catches_the_mistake_it_is_for():
    assert misplaced_tensors("dist.all_reduce(torch.ones(1))")
    assert misplaced_tensors("t = torch.zeros(2)\ndist.broadcast(t, src=0)")
    assert not misplaced_tensors("dist.all_reduce(torch.ones(1, device=ctx.device))")
    assert not misplaced_tensors("t = torch.zeros(2).to(ctx.device)\ndist.broadcast(t, src=0)")


@pytest.mark.parametrize("relative, source", sorted(workers.collect(ROOT).items()))
def test_no_worker_hands_a_cpu_tensor_to_a_collective(relative, source):
    assert not misplaced_tensors(source), (
        f"{relative} gives a collective a tensor made on the CPU; under NCCL it must be on "
        f"ctx.device: {misplaced_tensors(source)}")
