"""Exercise checks for chapter 06: fully sharded data parallel (ZeRO-1 by hand; an FSDP2
checkpoint saved on N ranks and loaded on one process)."""

from __future__ import annotations

import re
from pathlib import Path

from ._common import CheckFailed, close, first_failure, launch_reports, passed


def check_zero1(results: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Check a hand-written ZeRO stage 1 against DDP trained on the same batches.

    ``results[rank]`` (what ``launch(...).reports`` gives) holds: "zero1", the flat
    parameters of the rank's model after training; "ddp", the flat parameters of the DDP
    reference; "owned", the (start, end) slice of the flat parameters the rank steps;
    "optimizer_numel", how many elements of momentum the rank's optimizer keeps; and
    optionally "initial", the flat parameters before training, and "stepped", the values of
    the parameters the rank's optimizer holds after training (its slice).
    """
    ranks = sorted(results)
    if not ranks:
        raise CheckFailed("no rank reported anything: did the worker call runtime.report(...)?")
    total = results[ranks[0]]["ddp"].numel()
    world = len(ranks)
    not_gathered = ("the updated parameters were not all-gathered after the step: every rank "
                    "must all_gather the updated slices and copy them into its full model "
                    "before the next forward.")

    for rank in ranks:
        held = int(results[rank]["optimizer_numel"])
        if world > 1 and held >= total:
            raise CheckFailed(
                f"rank {rank} keeps optimizer state for {held:,} elements, the whole model "
                f"({total:,}): it steps the whole model, so the optimizer state is not sharded "
                f"(that is plain DDP memory). Give the optimizer only this rank's slice "
                f"flat[start:end] (about {total // world:,} elements) and step only that.")

    spans = sorted(tuple(int(i) for i in results[rank]["owned"]) for rank in ranks)
    position = 0
    for start, end in spans:
        if start != position or end < start:
            raise CheckFailed(
                f"the owned slices {spans} do not tile [0, {total:,}) without gaps or overlaps: "
                "rank r should own [r * shard_size, min((r + 1) * shard_size, total)).")
        position = end
    if position != total:
        raise CheckFailed(f"the owned slices {spans} stop at {position:,}, not at {total:,}: "
                          "round the shard size up (ceil(total / world_size)).")

    flat = {rank: results[rank]["zero1"].detach().double() for rank in ranks}
    for rank in ranks:
        initial = results[rank].get("initial")
        if initial is not None and close(flat[rank], initial, rtol, atol):
            start, end = (int(i) for i in results[rank]["owned"])
            stepped = results[rank].get("stepped")
            if stepped is not None and close(stepped, initial[start:end], rtol, atol):
                raise CheckFailed(f"rank {rank}: the model's parameters never changed, and neither did the "
                                  "slice its optimizer holds: every step saw a zero gradient (zeroed "
                                  "before optimizer.step(), or never handed to the slice's .grad).")
            raise CheckFailed(f"rank {rank}: the model's parameters never changed: the optimizer "
                              f"stepped its own copy of the slice, but {not_gathered}")
    for rank in ranks[1:]:
        if not close(flat[rank], flat[ranks[0]], rtol, atol):
            differ = (flat[rank] - flat[ranks[0]]).abs().max().item()
            raise CheckFailed(f"ranks {ranks[0]} and {rank} end with different parameters (max "
                              f"difference {differ:.2e}): {not_gathered}")

    for rank in ranks:
        zero1, ddp = flat[rank], results[rank]["ddp"].detach().double()
        if close(zero1, ddp, rtol, atol):
            continue
        start, end = (int(i) for i in results[rank]["owned"])
        error = (zero1 - ddp).abs().max().item()
        if close(zero1[start:end], ddp[start:end], rtol, atol):
            raise CheckFailed(
                f"rank {rank}: its own slice [{start:,}, {end:,}) matches DDP but the rest of "
                f"its model does not (max error {error:.2e}): {not_gathered}")
        raise CheckFailed(
            f"rank {rank}: the parameters differ from DDP (max error {error:.2e}). Average the "
            "gradients over ranks (all_reduce, then divide by the world size) before the step, "
            "and give the optimizer the gradient of its own slice.")
    passed(f"ZeRO-1 by hand on {world} ranks matches DDP; each rank keeps optimizer state for "
           f"{max(int(results[r]['optimizer_numel']) for r in ranks):,} of {total:,} elements")


# --- exercise 2: an FSDP2 checkpoint that outlives its job's shape ---

ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")
SAVE_RECIPE = ("model_state, optimizer_state = get_state_dict(model, optimizer), then "
               "dcp.save({\"model\": model_state, \"optimizer\": optimizer_state}, "
               "checkpoint_id=args.checkpoint) on every rank")
LOAD_RECIPE = ("dcp.load the dicts that get_state_dict(model, optimizer) returns (one call, model and "
               "optimizer together), then set_state_dict(model, optimizer, model_state_dict=..., "
               "optim_state_dict=...)")


def _check_units(units: set, params: dict) -> None:
    blocks = sorted({m.group(1) for name in params if (m := re.match(r"(layers\.\d+)\.", name))})
    if not units:
        raise CheckFailed("no module is an FSDP unit: fully_shard was never called, so every rank "
                          "trains a whole, unsharded copy. Call fully_shard(block, mesh=mesh) on each "
                          "block of model.layers, then fully_shard(model, mesh=mesh).")
    if "" not in units:
        raise CheckFailed(f"the blocks are FSDP units ({', '.join(sorted(units))}) but the root is not: "
                          "the embeddings, the final norm and the output layer stay plain tensors on every "
                          "rank, and nothing averages their gradients, so the ranks drift apart. Call "
                          "fully_shard(model, mesh=mesh) after the blocks.")
    unwrapped = [b for b in blocks if b not in units]
    if unwrapped:
        raise CheckFailed(
            f"{', '.join(unwrapped)} {'is' if len(unwrapped) == 1 else 'are'} not FSDP units of "
            f"{'its' if len(unwrapped) == 1 else 'their'} own (the units: "
            f"{', '.join(u or 'the root' for u in sorted(units))}): the root's unit then holds those blocks' "
            "parameters, and its forward gathers them all at once, so at its peak a rank holds them whole, "
            "as in DDP. Call fully_shard(block, mesh=mesh) on each block of model.layers first, then on "
            "the model.")


def _check_trained(first: dict, params: dict) -> None:
    import torch

    if all(torch.equal(params[n], first["initial"][n]) for n in params):
        raise CheckFailed(
            "the model never trained: after the steps its parameters are still the initial ones, and "
            "Adam holds no state for them. The optimizer was created before fully_shard: fully_shard "
            "replaces every parameter of the module with a new, sharded one (a DTensor), so Adam steps "
            "the old tensors, which get no gradients (and get_state_dict then fails with a KeyError on "
            "them). Build the optimizer after sharding.")


def _check_files(path: Path, world: int, params: dict) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    if not path.exists():
        raise CheckFailed(f"nothing was saved at {path}: save to args.checkpoint ({SAVE_RECIPE}).")
    files = sorted(f.name for f in path.iterdir()) if path.is_dir() else [path.name]
    if not (path / ".metadata").is_file():
        raise CheckFailed(
            f"{path} holds {files}, no .metadata: that is not a DCP checkpoint. torch.save on one rank "
            "writes that rank's view only (with FSDP, its shards, or whole tensors gathered through one "
            "process's memory), and nothing records how the pieces fit together. Use DCP: "
            f"{SAVE_RECIPE}. Each rank writes its own shards in parallel, and .metadata records where every "
            "piece of every tensor lives, which is what lets another sharding load it.")
    shards = [f for f in files if f.endswith(".distcp")]
    if len(shards) != world:
        raise CheckFailed(f"{path} holds {len(shards)} shard files for {world} ranks: every rank must call "
                          f"dcp.save (a collective), each writing its own shards.")
    keys = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    lacking = [n for n in params if not any(k == n or k.endswith("." + n) for k in keys)]
    if lacking:
        raise CheckFailed(f"the checkpoint has no entry for {len(lacking)} of the model's parameters (e.g. "
                          f"{lacking[0]!r}): save the whole model state, {SAVE_RECIPE}.")
    if any(re.search(r"\.state\.\d+\.exp_avg$", k) for k in keys):
        raise CheckFailed(
            "the optimizer state in the checkpoint is keyed by parameter numbers (optimizer.state_dict() "
            "numbers the parameters 0, 1, 2, ...), not names: a number means nothing to a model built or "
            "sharded another way, so no other job can match it. get_state_dict(model, optimizer) keys it "
            f"by parameter name, as the model's own state: {SAVE_RECIPE}.")
    if not any(k.endswith(".exp_avg") for k in keys):
        raise CheckFailed(
            "the checkpoint holds the model but no optimizer state: a job resumed from it would restart "
            "Adam from zero moments and step 0, a jolt in its training (and the step count of its bias "
            f"correction lost). Save both: {SAVE_RECIPE}.")


def _load(load, path: Path):
    import torch

    try:
        loaded = load(str(path))
    except NotImplementedError as error:
        raise CheckFailed("load_on_one_process is not written yet: replace the `raise "
                          "NotImplementedError` line with your code.") from error
    if (not isinstance(loaded, tuple) or len(loaded) != 2 or not isinstance(loaded[0], torch.nn.Module)
            or not isinstance(loaded[1], torch.optim.Optimizer)):
        raise CheckFailed(f"the load function returned {type(loaded).__name__}: return (model, optimizer).")
    return loaded


def _check_model(model, first: dict) -> dict:
    import torch

    loaded = dict(model.named_parameters())
    if loaded.keys() != first["params"].keys():
        raise CheckFailed("the loaded model's parameters are not the saved model's "
                          f"({len(loaded)} vs {len(first['params'])} names): build the same TinyTransformer.")
    differ = [name for name, p in loaded.items() if not torch.equal(p.detach(), first["params"][name])]
    if len(differ) == len(loaded):
        raise CheckFailed(
            "the loaded model holds none of the saved weights: nothing was loaded into it. dcp.load fills, "
            "in place, the tensors of the dict you pass it (loading into copies leaves the model as it "
            f"was): {LOAD_RECIPE}.")
    if differ:
        name = differ[0]
        gap = (loaded[name].detach().double() - first["params"][name].double()).abs().max().item()
        raise CheckFailed(
            f"the loaded {name} differs from the saved one by up to {gap:.2e} ({len(differ)} of "
            f"{len(loaded)} parameters differ). Loading copies the saved values, with no arithmetic, so "
            "they must be equal bit for bit: load the checkpoint the workers just wrote into a fresh "
            "model, and do not train or change it afterwards.")
    return loaded


def _check_optimizer(optimizer, loaded: dict, first: dict) -> None:
    import torch

    state = {name: optimizer.state[p] for name, p in loaded.items() if p in optimizer.state}
    if not any(state.values()):
        raise CheckFailed(
            "the loaded optimizer has no state: a new Adam has none until its first step, so its "
            "optimizer.state_dict() gives dcp.load nothing to fill (and loading only the model leaves "
            "Adam empty too). get_state_dict(model, optimizer) creates Adam's state for every parameter, "
            f"keyed by name as in the checkpoint: {LOAD_RECIPE}.")
    for name, saved in first["adam"].items():
        got = state.get(name, {})
        if set(got) != set(saved):
            raise CheckFailed(f"the loaded Adam state of {name} has {sorted(got)}, the saved one {sorted(saved)}: "
                              f"{LOAD_RECIPE}.")
    if not any(s["exp_avg"].any() or s["exp_avg_sq"].any() for s in state.values()):
        raise CheckFailed(
            "the loaded optimizer's moments are all zeros (the state get_state_dict creates for a new Adam): "
            "the model was loaded but the optimizer was not, so a resumed job would restart Adam from "
            f"scratch. Load both: {LOAD_RECIPE}.")
    for name, saved in first["adam"].items():
        for key in ADAM_STATE:
            if not torch.equal(torch.as_tensor(state[name][key]), torch.as_tensor(saved[key])):
                raise CheckFailed(
                    f"the loaded Adam {key} of {name} is not the saved one: the moments and the step must "
                    f"come back bit for bit (loading copies, no arithmetic). {LOAD_RECIPE}.")
    lr = optimizer.param_groups[0]["lr"]
    if lr != first["lr"]:
        raise CheckFailed(
            f"the loaded optimizer steps with lr {lr:g}; the saved job used {first['lr']:g}. dcp.load only "
            "fills the tensors of the dicts you give it; set_state_dict(model, optimizer, "
            "model_state_dict=..., optim_state_dict=...) called after dcp.load puts the loaded dicts into "
            "the model and the optimizer, hyperparameters (param_groups) included. Called before "
            "dcp.load, it applies the dicts while they still hold the fresh optimizer's values.")


def check_fsdp2_checkpoint(saved, checkpoint, load) -> None:
    """Check exercise 2: a model trained with FSDP2 on N ranks, saved with DCP, loads on one process.

    ``saved`` is the workers' LaunchResult (launched with ``check=False``: a rank that failed
    after training still reports what it trained). Its ``results[rank]`` hold "units" (the
    names of the modules that are FSDP units), "initial" and "params" (name -> the whole
    parameter before and after training), "adam" (name -> Adam's exp_avg, exp_avg_sq and step,
    gathered whole) and "lr". ``checkpoint`` is the folder the workers saved to, and
    ``load(checkpoint)`` returns (model, optimizer) in this process.

    The comparison is exact: full_tensor() all-gathers (it concatenates the shards), dcp.save
    writes the shards' bytes and dcp.load reads them back; no value goes through arithmetic.
    """
    world, path = saved.nproc, Path(checkpoint)
    first = launch_reports(saved, "the worker")[0]
    params = first["params"]
    _check_units(set(first["units"]), params)
    _check_trained(first, params)
    if not saved.ok:
        rank, code, error = first_failure(saved)
        hint = (" A rank waited in a collective that another rank never entered: get_state_dict and dcp.save "
                "are collectives, so every rank calls them (not only rank 0)." if "imed out" in error else "")
        raise CheckFailed(f"the model trained, but rank {rank} failed afterwards, while saving (exit code "
                          f"{code}): {error}.{hint} The cell above shows its traceback.")
    _check_files(path, world, params)
    model, optimizer = _load(load, path)
    loaded = _check_model(model, first)
    _check_optimizer(optimizer, loaded, first)
    step = int(next(iter(first["adam"].values()))["step"])
    passed(f"the model and Adam state trained on {world} ranks (FSDP units {sorted(first['units'])}) load on "
           f"one process bit for bit: {len(params)} parameters, their two moments and step {step}")
