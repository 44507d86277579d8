"""checks.check_fsdp2_checkpoint (chapter 06, exercise 2) passes the solution and names the usual
mistakes, each planted in a copy of the solution: in the worker (launched on 2 ranks, the
fewest that shard anything) or in the load function (run here, on one process, against the
checkpoint of the solution's worker, which one launch for the whole module writes)."""

import re
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
import torch

import spike_course
from spike_course import checks
from spike_course.checks import CheckFailed

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = nbformat.read(ROOT / "solutions" / "06_fully_sharded_data_parallel.ipynb", as_version=4)
WORKER = "workers/06_fully_sharded_data_parallel/fsdp2_checkpoint.py"
REGION = re.compile(r"[ \t]*### BEGIN SOLUTION\n.*?### END SOLUTION\n", re.S)
# Loading with no process group is the point here; DCP warns that it assumes one process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _cell(start: str) -> str:
    return next(c.source for c in SOLUTION.cells if c.cell_type == "code" and start in c.source)


# The sharding is given code in the exercise (the lecture teaches it); a learner may still
# change it, and the check names what goes wrong then.
GIVEN_SHARDING = """\
mesh = init_device_mesh(device_type, (ctx.world_size,))
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=LR)
"""


def planted_worker(shard: str | None = None, save: str | None = None) -> str:
    """The solution's worker with its sharding and its solution region (the save) replaced
    where given."""
    source = _cell(f"%%writefile {WORKER}").split("\n", 1)[1]
    regions = REGION.findall(source)
    assert len(regions) == 1 and GIVEN_SHARDING in source, "the worker changed: update this test"
    if shard is not None:
        source = source.replace(GIVEN_SHARDING, shard)
    if save is not None:
        source = source.replace(regions[0], save)
    return source


def planted_load(body: str | None = None):
    """The solution's load_on_one_process, its region replaced by ``body`` (indented 4)."""
    source = _cell("def load_on_one_process(")
    if body is not None:
        source = REGION.sub(lambda _: body, source)
    namespace = {"torch": torch, "SCALE": 1}
    exec(source, namespace)
    return namespace["load_on_one_process"]


def launch(path, checkpoint, nproc=2):
    # check=False, as in the notebook: the check reads a failed launch's reports itself
    return spike_course.launch(path, nproc=nproc, args=["--checkpoint", checkpoint], check=False,
                               echo=False, progress=False, timeout=120)


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """The solution's worker, run once: its launch result and its checkpoint folder."""
    folder = tmp_path_factory.mktemp("solved")
    (folder / "worker.py").write_text(planted_worker())
    saved = launch(folder / "worker.py", folder / "checkpoint")
    assert saved.ok, saved.output
    return saved, folder / "checkpoint"


@pytest.mark.processes
def test_the_solution_passes(solved, capsys):
    saved, checkpoint = solved
    checks.check_fsdp2_checkpoint(saved, checkpoint, planted_load())
    assert "check passed" in capsys.readouterr().out


# --- mistakes in the worker: each planted copy is launched ---

OPTIMIZER_FIRST = """\
optimizer = torch.optim.Adam(model.parameters(), lr=LR)
mesh = init_device_mesh(device_type, (ctx.world_size,))
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
"""
ROOT_ONLY = """\
mesh = init_device_mesh(device_type, (ctx.world_size,))
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=LR)
"""
MODEL_ONLY = """\
model_state, optimizer_state = get_state_dict(model, optimizer)
dcp.save({"model": model_state}, checkpoint_id=args.checkpoint)
"""
TORCH_SAVE = """\
if ctx.is_main:  # the habit of DDP: rank 0 saves
    import os
    os.makedirs(args.checkpoint, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(args.checkpoint, "checkpoint.pt"))
"""
NUMBERED_STATE = """\
dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=args.checkpoint)
"""


@pytest.mark.processes
@pytest.mark.parametrize("shard, save, message", [
    (OPTIMIZER_FIRST, None, r"never trained.*created before fully_shard"),
    (ROOT_ONLY, None, r"layers\.0, layers\.1 are not FSDP units of their own"),
    (None, MODEL_ONLY, r"no optimizer state"),
    (None, TORCH_SAVE, r"no \.metadata: that is not a DCP checkpoint"),
    (None, NUMBERED_STATE, r"keyed by parameter numbers"),
], ids=["optimizer-before-fully_shard", "blocks-not-wrapped", "model-only-saved", "torch.save-on-rank-0",
        "optimizer.state_dict-saved"])
def test_a_worker_mistake_is_named(worker, tmp_path, no_orphans, shard, save, message):
    saved = launch(worker(planted_worker(shard, save)), tmp_path / "checkpoint")
    with pytest.raises(CheckFailed, match=message):
        checks.check_fsdp2_checkpoint(saved, tmp_path / "checkpoint", planted_load())


# --- mistakes the workers' reports show, without another launch ---

@pytest.mark.processes
def test_the_blank_worker_is_named(solved):
    saved, checkpoint = solved
    blank = replace(saved, returncodes={0: 1, 1: 1}, reports={}, output={
        0: ["Traceback (most recent call last):", "NotImplementedError: exercise: replace this line"], 1: []})
    with pytest.raises(CheckFailed, match="worker is not written yet"):
        checks.check_fsdp2_checkpoint(blank, checkpoint, planted_load())


@pytest.mark.processes
def test_a_root_left_unsharded_is_named(solved):
    saved, checkpoint = solved
    results = {r: {**report, "units": ["layers.0", "layers.1"]} for r, report in saved.reports.items()}
    with pytest.raises(CheckFailed, match="the root is not"):
        checks.check_fsdp2_checkpoint(replace(saved, reports=results), checkpoint, planted_load())


@pytest.mark.processes
def test_saving_on_rank_0_only_is_named(solved):
    """dcp.save under `if rank == 0`: rank 0 waits in the save's collective until the 60 s
    timeout (too slow to launch here), after both ranks reported what they trained."""
    saved, checkpoint = solved
    hung = replace(saved, returncodes={0: 0, 1: 1}, output={0: [], 1: [
        "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv"]})
    with pytest.raises(CheckFailed, match="every rank calls them"):
        checks.check_fsdp2_checkpoint(hung, checkpoint, planted_load())


# --- mistakes in the load function: planted copies, all loading the solution's checkpoint ---

MODEL_LOADED_ONLY = """\
    dcp.load({"model": model.state_dict()}, checkpoint_id=checkpoint)
"""
PLAIN_STATE_DICTS = """\
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
"""
OPTIMIZER_LEFT_OUT = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state}, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
"""
NOT_SET = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint)
"""
SET_BEFORE_LOAD = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint)
"""
INTO_COPIES = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": {k: v.clone() for k, v in model_state.items()}, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=checkpoint)
"""
BLANK = """\
    raise NotImplementedError("exercise: replace this line with your code")
"""


@pytest.mark.processes
@pytest.mark.parametrize("body, message", [
    (MODEL_LOADED_ONLY, r"optimizer has no state"),
    (PLAIN_STATE_DICTS, r"optimizer has no state.*optimizer\.state_dict\(\) gives dcp\.load nothing"),
    (OPTIMIZER_LEFT_OUT, r"moments are all zeros"),
    (NOT_SET, r"lr 0\.001; the saved job used 0\.01.*set_state_dict"),
    (SET_BEFORE_LOAD, r"lr 0\.001.*Called before\s+dcp\.load"),
    (INTO_COPIES, r"none of the saved weights"),
    (BLANK, r"load_on_one_process is not written yet"),
], ids=["model-only", "optimizer.state_dict-of-a-new-Adam", "optimizer-left-out-of-dcp.load",
        "no-set_state_dict", "set_state_dict-before-dcp.load", "loaded-into-copies", "blank"])
def test_a_load_mistake_is_named(solved, body, message):
    saved, checkpoint = solved
    with pytest.raises(CheckFailed, match=re.compile(message, re.S)):
        checks.check_fsdp2_checkpoint(saved, checkpoint, planted_load(body))
