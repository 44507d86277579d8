"""Exercise checks for the capstone: the learner's own MNIST script as a torchrun job.

:func:`check_capstone_job` runs the learner's file the way a cluster does, under bare
``python -m torch.distributed.run --standalone --nproc-per-node=2`` in a Python where
``spike_course`` cannot be imported, and compares what it leaves behind (its checkpoint
and the accuracies rank 0 appends to a metrics file) with a private single-process
reference. A ``sitecustomize`` on the ranks' ``PYTHONPATH`` records a few calls
(``torch.save`` and who made it, the loaders' samplers, ``set_epoch``,
``destroy_process_group``) so that a wrong answer can be named, not just detected.
:func:`check_capstone_submit` checks the ``runai training pytorch submit`` line.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..cluster_image import import_blocker
from ._common import CheckFailed, passed

# Small enough for a few seconds per launch on 2 CPU cores. TEST_SAMPLES is odd on purpose:
# a DistributedSampler pads 201 samples to 2 x 101, so a metric over padded shards counts
# one sample twice and shows up as a different fraction.
TRAIN_SAMPLES, TEST_SAMPLES, BATCH, WORLD, SEED = 256, 201, 16, 2, 1
STEPS_PER_EPOCH = TRAIN_SAMPLES // (BATCH * WORLD)
LR, GAMMA = 1.0, 0.7
LAUNCH_TIMEOUT = 180  # seconds per torchrun; gloo would wait 30 minutes in a broken collective

# Loaded by every Python the capstone check starts: blocks spike_course, records calls.
SITECUSTOMIZE = import_blocker(
    ["spike_course"], "is not installed on the cluster: the capstone script must not import "
    "spike_course (copy what you need into the script)") + '''
import json
import os

if "RANK" in os.environ:  # a worker, not torchrun's agent
    import torch
    import torch.distributed
    # Before the script's init_process_group, as runtime.setup does (see there): imported
    # later, it keeps the group alive past destroy_process_group and exits can abort.
    import torch.distributed.nn
    from torch.utils.data import DataLoader, DistributedSampler

    LOG = os.path.join(os.environ["CAPSTONE_CHECK_LOG"], f"calls_{os.getpid()}.jsonl")
    WHO = {"rank": int(os.environ["RANK"]),
           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}

    def record(**event):
        with open(LOG, "a") as out:
            out.write(json.dumps({**WHO, **event}) + "\\n")

    def wrap(owner, name, describe):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            try:
                record(call=name, **describe(*args, **kwargs))
            except Exception:  # recording must never break the learner's program
                pass
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    wrap(torch, "save", lambda obj, f, *a, **k: {"path": os.path.abspath(os.fspath(f))
                                                 if isinstance(f, (str, os.PathLike)) else None})
    wrap(DataLoader, "__init__", lambda self, dataset, *a, **k: {
        "size": len(dataset), "sampler": type(k.get("sampler")).__name__
        if k.get("sampler") is not None else None})
    wrap(DistributedSampler, "set_epoch", lambda self, epoch: {"epoch": epoch})
    wrap(torch.distributed, "destroy_process_group", lambda *a, **k: {})
'''


# --- the private reference -------------------------------------------------------------


def _datasets(path):
    import torch

    saved = torch.load(path)

    def normalised(images, labels):
        return ((images.float() / 255 - 0.1307) / 0.3081).unsqueeze(1), labels

    return normalised(*saved["train"]), normalised(*saved["test"])


def _reference(data_path, epochs, set_epoch=True):
    """The 2-rank DDP run in one process: per step, each rank's batch's gradient, averaged.

    It does the ranks' arithmetic exactly: the same batches of BATCH samples through the
    same kernels (one thread here as on the ranks), then g0/2 + g1/2, which is what DDP
    computes (it divides each rank's gradient by the world size and sums the two: for two
    ranks that sum is the same in either order, and halving is exact).
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

    from ..models import Net

    (x, y), _ = _datasets(data_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        model = Net(dropout=False)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        samplers = [DistributedSampler(range(len(y)), num_replicas=WORLD, rank=r, shuffle=True)
                    for r in range(WORLD)]
        for epoch in range(1, epochs + 1):
            orders = []
            for sampler in samplers:
                sampler.set_epoch(epoch if set_epoch else 0)
                orders.append(list(sampler))
            for step in range(STEPS_PER_EPOCH):
                grads = []
                for order in orders:
                    batch = order[step * BATCH:(step + 1) * BATCH]
                    model.zero_grad()
                    F.nll_loss(model(x[batch]), y[batch]).backward()
                    grads.append([p.grad / WORLD for p in model.parameters()])
                for p, *rank_grads in zip(model.parameters(), *grads):
                    p.grad = sum(rank_grads[1:], rank_grads[0])
                optimizer.step()
            scheduler.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _test_counts(weights, data_path):
    """(correct, ambiguous, rank-0-only correct) of ``weights`` over the test set; a sample is
    ambiguous when its two best log-probabilities lie so close that another batch size's
    rounding could swap them."""
    import torch

    from ..models import Net

    _, (x, y) = _datasets(data_path)
    model = Net(dropout=False)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        logp = model(x)
    top2 = logp.topk(2, dim=1).values
    hit = logp.argmax(dim=1) == y
    ambiguous = int((top2[:, 0] - top2[:, 1] < 1e-4).sum())
    return int(hit.sum()), ambiguous, hit


# --- running the learner's script ------------------------------------------------------


def _launch(script, folder, args, max_restarts=0):
    """torchrun 2 ranks of ``script`` in ``folder``; return (exit code, output, call log)."""
    from ..launcher import stop_process_tree

    folder = Path(folder)
    log_dir = folder / "calls"
    log_dir.mkdir(exist_ok=True)
    for old in log_dir.glob("*.jsonl"):
        old.unlink()
    (folder / "site").mkdir(exist_ok=True)
    (folder / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKE_COURSE_", "PET_"))}
    # One thread per rank, as the reference uses: the same kernels give the same floats.
    # CUDA hidden: the comparison is exact on the CPU (gloo); the lecture shows the GPU run.
    # A restarted round gets its own store (chapter 07: pytorch issues 135712 and 167288).
    env.update(PYTHONPATH=str(folder / "site"), CAPSTONE_CHECK_LOG=str(log_dir), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={WORLD}", f"--max-restarts={max_restarts}",
               str(Path(script).resolve()), *[str(a) for a in args]]
    # torchrun puts its workers in their own session: stop the whole tree on a timeout.
    proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_process_tree([proc])
        raise CheckFailed(f"your script ran for more than {LAUNCH_TIMEOUT} s on {TRAIN_SAMPLES} "
                          "samples and was stopped: a rank is most likely waiting in a collective "
                          "(all_reduce, barrier) that another rank never reaches, e.g. one inside "
                          "`if rank == 0:`.") from None
    calls = []
    for path in sorted(log_dir.glob("*.jsonl")):
        calls += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return proc.returncode, output, calls


def _explain_failure(output):
    # The ranks' tracebacks come first; torchrun's own (ChildFailedError) and summary follow.
    start = output.find("Traceback (most recent call last)")
    lines = output[start:].splitlines() if start >= 0 else output.strip().splitlines()[-25:]
    tail = "\n".join(lines[:30])
    if "mutually exclusive with shuffle" in output:
        return ("DataLoader refused sampler= together with shuffle=True: the DistributedSampler "
                "shuffles (differently every epoch, once you call set_epoch), so remove shuffle=True "
                "from the training loader.")
    if "spike_course is not installed on the cluster" in output:
        return "your script imports spike_course, which the cluster does not have: use torch only."
    if "NotImplementedError" in output:
        return "some marked places still raise NotImplementedError: fill them in."
    if "KeyError: 'LOCAL_RANK'" in output or "KeyError: 'RANK'" in output:
        return "read RANK, LOCAL_RANK and WORLD_SIZE from os.environ: torchrun sets them."
    return f"your script failed under torchrun. The end of its output:\n{tail}"


def _unfilled_places(source):
    """Name the places that still raise NotImplementedError, before any rank is started."""
    lines = [number for number, line in enumerate(source.splitlines(), 1)
             if line.strip().startswith("raise NotImplementedError")]
    if lines:
        raise CheckFailed(f"lines {lines} of your script still raise NotImplementedError: fill in those "
                          "places (no rank was started).")


def _static_mistakes(source):
    """Mistakes visible in the source, which a CPU run cannot show (device_ids is None there)."""
    tree = ast.parse(source)
    assigned = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "spike_course" or n.startswith("spike_course.") for n in names):
                raise CheckFailed("your script imports spike_course, which the cluster does not "
                                  "have: the job must need torch only.")

    def not_a_list(expr, seen=()):
        """True when ``expr`` is certainly not a list (an int, a device, a rank variable...)."""
        if isinstance(expr, ast.IfExp):
            return not_a_list(expr.body, seen) or not_a_list(expr.orelse, seen)
        if isinstance(expr, ast.Constant):
            return expr.value is not None
        if isinstance(expr, ast.Call):
            name = ast.unparse(expr.func)
            return name in ("int", "torch.device", "device") or name.endswith(".current_device")
        if isinstance(expr, ast.Attribute):
            return expr.attr in ("index", "device")
        if isinstance(expr, ast.Name) and expr.id not in seen and expr.id in assigned:
            return all(not_a_list(v, seen + (expr.id,)) for v in assigned[expr.id])
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in (
                "DDP", "DistributedDataParallel"):
            for keyword in node.keywords:
                if keyword.arg == "device_ids" and not_a_list(keyword.value):
                    raise CheckFailed(
                        f"device_ids={ast.unparse(keyword.value)} is not a list: DDP wants the list "
                        "of the ONE GPU this process uses, device_ids=[local_rank], and None on the "
                        "CPU. (The cluster guide passes a torch.device here, which fails on a GPU.)")


def _tensors(dataset):
    """(uint8 images, labels) of the synthetic digits or of a Subset of torchvision's MNIST."""
    import torch

    if hasattr(dataset, "indices"):  # Subset(MNIST, range(limit))
        index = torch.as_tensor(list(dataset.indices))
        return dataset.dataset.data[index], dataset.dataset.targets[index]
    return dataset.data, dataset.targets


def _compare(weights, expected):
    """The largest absolute difference between two state dicts (inf if names differ)."""
    if set(weights) != set(expected):
        return float("inf")
    return max((weights[k].double() - expected[k].double()).abs().max().item() for k in expected)


def _metrics(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_capstone_job(script, folder) -> None:
    """Run the learner's ``script`` under bare torchrun with 2 ranks, twice: one epoch, then
    (resuming from its checkpoint) a second epoch with a crash and a restart, and compare
    its weights and test accuracy with the single-process reference."""
    import torch

    from ..data import load_mnist

    # Absolute paths: the ranks run in the check's folder, not in the notebook's.
    script, folder = Path(script).resolve(), (Path(folder) / "capstone_check").resolve()
    if not script.exists():
        raise CheckFailed(f"{script} does not exist: run the %%writefile cell first.")
    _unfilled_places(script.read_text())
    _static_mistakes(script.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.pt"
    train, test = load_mnist(train=True, limit=TRAIN_SAMPLES), load_mnist(train=False, limit=TEST_SAMPLES)
    torch.save({"train": _tensors(train), "test": _tensors(test)}, data)
    checkpoint, metrics = folder / "ckpt.pt", folder / "metrics.jsonl"
    for old in folder.glob("ckpt.pt*"):
        old.unlink()
    metrics.unlink(missing_ok=True)
    args = ["--data", data, "--batch-size", BATCH, "--test-batch-size", 64, "--lr", LR,
            "--gamma", GAMMA, "--dropout", 0, "--seed", SEED, "--checkpoint", checkpoint,
            "--metrics", metrics, "--log-interval", 1000]

    # Run 1: one epoch from scratch.
    code, output, calls = _launch(script, folder, args + ["--epochs", 1])
    saves = [c for c in calls if c["call"] == "save"]
    savers = sorted({c["rank"] for c in saves})
    if savers and savers != [0]:  # checked first: it is often what made the run fail
        raise CheckFailed(f"ranks {savers} all called torch.save: every rank holds the same model, so "
                          "only rank 0 should write (if rank == 0: ...), then dist.barrier(). Several "
                          "ranks writing one file at once leave a corrupt checkpoint, or one rank's "
                          "os.replace finds the temporary file already gone.")
    if code != 0:
        raise CheckFailed(_explain_failure(output))
    if not checkpoint.exists():
        raise CheckFailed(f"no checkpoint at --checkpoint {checkpoint.name} after the epoch: rank 0 must "
                          "save it there at the end of every epoch.")
    if any(c["path"] == os.path.abspath(checkpoint) for c in saves):
        raise CheckFailed("torch.save wrote straight to the checkpoint path: a crash in the middle leaves "
                          "half a file and loses the previous checkpoint. Save to a temporary file next "
                          "to it, then os.replace(tmp, path), which is atomic.")
    destroyed = {c["rank"] for c in calls if c["call"] == "destroy_process_group"}
    if destroyed != set(range(WORLD)):
        raise CheckFailed(f"dist.destroy_process_group() was not called on ranks "
                          f"{sorted(set(range(WORLD)) - destroyed)}: call it at the end of the script, "
                          "after the last barrier, so every rank shuts its connections down cleanly.")
    state = torch.load(checkpoint)
    missing = [k for k in ("model", "optimizer", "scheduler", "epoch") if k not in state]
    if missing:
        raise CheckFailed(f"the checkpoint lacks {missing}: save a dict with model, optimizer, "
                          "scheduler and epoch, or a resumed run cannot continue exactly.")
    if any(k.startswith("module.") for k in state["model"]):
        raise CheckFailed("the checkpoint's model keys start with 'module.' (e.g. "
                          f"{next(iter(state['model']))!r}): that is the DDP wrapper's state_dict. Save "
                          "ddp_model.module.state_dict() (or the unwrapped model's), so the file loads "
                          "into a plain Net for testing or inference, with or without DDP.")

    expected = _reference(data, epochs=1)
    gap = _compare(state["model"], expected)
    # Tolerance 0: the ranks and the reference do the same float operations (see _reference).
    if gap != 0:
        if _compare(state["model"], _reference(data, epochs=1, set_epoch=False)) == 0:
            raise CheckFailed("epoch 1 trained on the sampler's epoch-0 shuffle, which is what happens "
                              "when set_epoch is never called (every epoch then has the same shuffle "
                              "as epoch 1): call train_sampler.set_epoch(epoch) before each epoch.")
        train_loaders = [c for c in calls if c["call"] == "__init__" and c["size"] == TRAIN_SAMPLES]
        if train_loaders and any(c["sampler"] != "DistributedSampler" for c in train_loaders):
            raise CheckFailed("the training DataLoader has no DistributedSampler: every rank trains on "
                              "the whole data set, so the 2 ranks repeat each other's work. Pass "
                              "sampler=DistributedSampler(train_set) to the training loader.")
        raise CheckFailed(f"after one epoch the weights differ from the single-process reference by "
                          f"up to {gap:.3g}. Is the model wrapped in DDP (so gradients are averaged), "
                          "the same seed used on every rank, the batch size per rank unchanged?")

    correct, ambiguous, hits = _test_counts(expected, data)
    runs = _metrics(metrics)
    if not runs or runs[-1].get("epoch") != 1 or "test_accuracy" not in runs[-1]:
        raise CheckFailed(f"rank 0 should append {{'epoch': 1, 'test_accuracy': ...}} to --metrics; "
                          f"found {runs}.")
    reported = runs[-1]["test_accuracy"]
    # Any two different fractions with denominators <= 202 differ by > 1e-5; float division
    # errs by ~1e-16, so 1e-9 tells them apart. `ambiguous` samples may legitimately flip.
    if not any(abs(reported - (correct + d) / TEST_SAMPLES) < 1e-9
               for d in range(-ambiguous, ambiguous + 1)):
        rank0 = hits[0::WORLD]
        if abs(reported - rank0.float().mean().item()) < 1e-6 or abs(
                reported - int(hits[1::WORLD].sum()) / len(hits[1::WORLD])) < 1e-6:
            raise CheckFailed(f"the test accuracy {reported:.4f} is rank 0's own shard only (the whole "
                              f"test set gives {correct / TEST_SAMPLES:.4f}): all_reduce the numbers of "
                              "correct answers and of samples over the ranks, then divide.")
        if abs(reported * (TEST_SAMPLES + 1) - round(reported * (TEST_SAMPLES + 1))) < 1e-6:
            raise CheckFailed(f"the test accuracy {reported:.4f} counts {TEST_SAMPLES + 1} samples, but "
                              f"the test set has {TEST_SAMPLES}: a DistributedSampler pads the last shard "
                              "with repeats. Give each rank range(rank, N, world_size) of the test set.")
        raise CheckFailed(f"the test accuracy {reported:.6f} is not the accuracy of the trained weights "
                          f"over the whole test set ({correct / TEST_SAMPLES:.6f}): count correct answers "
                          "and samples on each rank, all_reduce both (SUM), divide.")

    # Run 2: two epochs, resuming from run 1's checkpoint; one crash in epoch 2, one restart.
    crash_at = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2
    code, output, calls = _launch(script, folder, args + ["--epochs", 2, "--crash-at", crash_at],
                                  max_restarts=1)
    if code != 0:
        raise CheckFailed(_explain_failure(output))
    if not any(c["restart"] == 1 for c in calls):
        raise CheckFailed(f"the run was not restarted: the crash at step {crash_at} (--crash-at) never "
                          "happened. Keep the crash lines of the training loop as they are.")
    evaluated = [m.get("epoch") for m in _metrics(metrics)]
    if evaluated != [1, 2]:
        raise CheckFailed(f"the epochs evaluated, in order, were {evaluated} (expected [1, 2]): the second "
                          "run should load the checkpoint of epoch 1 and continue with epoch 2. Load "
                          "model, optimizer and scheduler from it and start at its epoch + 1.")
    state = torch.load(checkpoint)
    expected = _reference(data, epochs=2)
    if _compare(state["model"], expected) != 0:
        if _compare(state["model"], _reference(data, epochs=2, set_epoch=False)) == 0:
            raise CheckFailed("epoch 2 trained on the same shuffle as epoch 1: call "
                              "train_sampler.set_epoch(epoch) before each epoch, or every epoch sees "
                              "the samples in the same order.")
        raise CheckFailed("epoch 1 matched the reference, but after resuming, epoch 2 does not: restore "
                          "the optimizer and the scheduler too, and call set_epoch(epoch) every epoch.")
    passed(f"2 ranks under torchrun match the single-process reference exactly after 1 and 2 epochs "
           f"({STEPS_PER_EPOCH} steps each), the test accuracy counts each of the {TEST_SAMPLES} samples "
           "once, only rank 0 saves (atomically, plain keys), and the run crashed, restarted and resumed")


def check_capstone_submit(line: str, script: str = "train.py", nodes: int = 2,
                          gpus_per_node: int = 8) -> None:
    """The Run:ai line runs ``script`` on ``nodes`` DGX nodes with all their GPUs."""
    if not isinstance(line, str) or not line.startswith("runai "):
        raise CheckFailed(f"expected the runai command line as a string, got {line!r}: build it with "
                          "spike_course.runai.submit_command(...).")
    words = shlex.split(line)

    def value(flag):
        return words[words.index(flag) + 1] if flag in words else None

    if words[1:4] != ["training", "pytorch", "submit"]:
        raise CheckFailed("this is not a distributed PyTorch workload: `runai training submit` makes "
                          "ONE pod. Pass workers=... to submit_command for `runai training pytorch "
                          "submit`, so the training operator starts the pods and their rendezvous.")
    master = "--no-master" not in words  # Run:ai adds a master pod, which trains too, unless told not to
    pods = int(value("--workers")) + master
    if pods != nodes:
        raise CheckFailed(f"this line asks for {pods} pods ({value('--workers')} workers"
                          + (" and the master pod Run:ai adds" if master else ", no master") +
                          f"), each a whole DGX node, but the job should use {nodes} nodes: count every "
                          "pod that trains.")
    if value("--gpu-devices-request") != str(gpus_per_node):
        raise CheckFailed(f"--gpu-devices-request is {value('--gpu-devices-request')}: a pod is one node "
                          f"here, so ask for all its {gpus_per_node} GPUs (gpus={gpus_per_node}).")
    command = " ".join(words[words.index("--") + 1:]) if "--" in words else ""
    if "torchrun" not in command and "torch.distributed.run" not in command:
        raise CheckFailed("the pod's command does not start torchrun: plain python starts one process, "
                          "but the script reads RANK/LOCAL_RANK that torchrun sets, one per GPU.")
    if "--standalone" in command:
        raise CheckFailed("--standalone makes every pod a job of its own (a private rendezvous on "
                          "localhost): leave it out, torchrun reads the shared rendezvous from the "
                          "PET_* variables the operator injects.")
    if any(option in command for option in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint",
                                             "--master-addr", "--master_addr", "--node-rank")):
        raise CheckFailed("the command names nodes or the rendezvous itself: leave those to the "
                          "operator's PET_* variables (runai.torchrun_command does), or a restarted "
                          "or rescheduled pod meets at the wrong place.")
    per_node = [w for w in shlex.split(command) if w.startswith("--nproc-per-node")]
    if not per_node or per_node[0].split("=")[-1] not in (str(gpus_per_node), "gpu"):
        raise CheckFailed(f"torchrun should start one process per GPU, --nproc-per-node={gpus_per_node} "
                          f"(or gpu), got {per_node or 'none'}.")
    if script not in command:
        raise CheckFailed(f"the command does not run {script}.")
    if value("--existing-pvc") is None or "/data" not in command:
        raise CheckFailed("mount the team's volume (pvc=...) and keep the script and --checkpoint "
                          "on it (cd /data/...): a pod's own disk disappears with the pod, and with "
                          "it the checkpoint a restarted job needs.")
    passed(f"`runai training pytorch submit` with {nodes} pods of {gpus_per_node} GPUs, each "
           f"running torchrun on {script} with the rendezvous from the PET_* variables")
