"""Exercise checks for the capstone: a group's one-GPU script, converted by the learner into
a torchrun job that needs nothing but torch.

:func:`check_capstone_job` runs the learner's file as a cluster would: under bare torchrun,
as two nodes of one rank each (so RANK and LOCAL_RANK differ on the second), in a Python
where ``spike_course`` cannot be imported (``capstone_run``). Rank 1 is crashed once in the
second epoch and torchrun restarts the job, which must resume. The ranks record what they
did (``capstone_probe``), and the check judges that behaviour step by step, in the order a
conversion is done, stopping at the first thing that is wrong:

1. every rank joined the process group, and the job ran (a hang, a traceback);
2. each rank trained on its own part of the data, with the global batch of ``--batch-size``
   whatever the number of ranks, micro-batches no larger than ``--micro-batch``, the same
   initial weights, train mode, one all-reduce per optimizer step, and the schedule of the
   one-GPU script;
3. one writer: only rank 0 saves, logs and prints;
4. the checkpoint: plain keys, written atomically, waited for by the other ranks;
5. the evaluation counts each test sample once, and reports the accuracy of the weights;
6. the restart resumes exactly: the checkpoint read with ``map_location``, the optimizer and
   the scheduler restored, a new shuffle every epoch, the same data order as before the crash;
7. the weights equal a replay of DDP's arithmetic on the batches the ranks recorded, bit for
   bit (so a correct answer with its own seed or epoch numbering passes: the replay follows it);
8. on nodes with a GPU (pretended: one GPU for two processes per node, as under a Run:ai GPU
   fraction; the probe records the choices and stops at DDP), NCCL and GPU LOCAL_RANK modulo
   the node's GPUs, in set_device, the model's placement and DDP's device_ids.

:func:`check_capstone_submit` checks the ``runai training pytorch submit`` line.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
from collections import Counter
from pathlib import Path

from . import capstone_run
from ._common import CheckFailed, passed

# The job the check runs: small enough for seconds on 2 CPU cores. TEST_SAMPLES is odd: a
# DistributedSampler pads 201 samples to 2 x 101, so padded shards count a sample twice.
TRAIN_SAMPLES, TEST_SAMPLES, WORLD = 256, 201, capstone_run.NODES
GLOBAL_BATCH, MICRO_BATCH, EPOCHS = 32, 8, 2
STEPS_PER_EPOCH = TRAIN_SAMPLES // GLOBAL_BATCH
LR, WEIGHT_DECAY, WARMUP_STEPS, CLIP, SEED = 2e-3, 0.05, 4, 1.0, 0
CRASH_RANK, CRASH_AFTER = 1, STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2  # in epoch 1, after epoch 0's save
SAVE_DELAY = 0.5  # rank 0 lingers in torch.save this long: a rank that goes on did not wait


def _options(data, checkpoint, metrics):
    return ["--data", data, "--epochs", EPOCHS, "--batch-size", GLOBAL_BATCH, "--micro-batch", MICRO_BATCH,
            "--lr", LR, "--weight-decay", WEIGHT_DECAY, "--warmup-steps", WARMUP_STEPS, "--clip", CLIP,
            "--seed", SEED, "--workers", 0, "--log-every", 4, "--checkpoint", checkpoint,
            "--metrics", metrics]


# --- the one-GPU script's model, data and schedule, for the replay -------------------------------


def _model():
    import torch.nn as nn

    class DigitClassifier(nn.Module):  # single.py's model
        def __init__(self, hidden=128):
            super().__init__()
            self.layers = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.GELU(),
                                        nn.LayerNorm(hidden), nn.Linear(hidden, 10))

        def forward(self, images):
            return self.layers(images)

    return DigitClassifier()


def _tensors(data_path):
    """((train images, labels), (test images, labels)), normalised as single.py does."""
    import torch

    saved = torch.load(data_path)

    def normalised(images, labels):
        return ((images.float() / 255 - 0.1307) / 0.3081).unsqueeze(1), labels

    return normalised(*saved["train"]), normalised(*saved["test"])


def _learning_rate(step, total_steps=EPOCHS * STEPS_PER_EPOCH):
    """single.py's warm-up and cosine at optimizer step ``step`` (from 0)."""
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return LR * 0.5 * (1 + math.cos(math.pi * progress))


def _write_data(path):
    import torch

    from ..data import load_mnist

    def tensors(dataset):
        if hasattr(dataset, "indices"):  # Subset(MNIST, range(limit))
            index = torch.as_tensor(list(dataset.indices))
            return dataset.dataset.data[index], dataset.dataset.targets[index]
        return dataset.data, dataset.targets

    train, test = load_mnist(train=True, limit=TRAIN_SAMPLES), load_mnist(train=False, limit=TEST_SAMPLES)
    torch.save({"train": tensors(train), "test": tensors(test)}, path)


# --- what the ranks did, read from their events ------------------------------------------------


class Run:
    """One rank's attempt, parsed: its optimizer steps (each with the micro-batches that made
    it), its evaluations, and the events themselves."""

    def __init__(self, events):
        self.events, self.steps, self.evaluations = events, [], []
        micro, evaluation, step_count = [], None, 0
        for event in events:
            if event["kind"] == "forward" and event["grad"]:
                micro.append(event["ids"])
                evaluation = None
            elif event["kind"] == "forward":
                if evaluation is None:
                    evaluation = {"after_steps": step_count, "ids": []}
                    self.evaluations.append(evaluation)
                evaluation["ids"] += event["ids"]
            elif event["kind"] == "step":
                self.steps.append(dict(event, micro=micro))
                micro, evaluation, step_count = [], None, step_count + 1
        self.pending = micro  # forwards after the last step (a crash in the middle of one)

    def samples(self, steps) -> list[int]:
        return [i for step in steps for ids in step["micro"] for i in ids]

    def epoch(self, number) -> list[dict]:
        """The steps between evaluation number-1 and evaluation number (all, if none follows)."""
        start = self.evaluations[number - 1]["after_steps"] if number else 0
        end = self.evaluations[number]["after_steps"] if number < len(self.evaluations) else len(self.steps)
        return self.steps[start:end]


def _runs(job, attempt) -> dict:
    return {rank: Run(job.of(rank, attempt)) for rank in range(WORLD)}


def _lines_printed(job, rank, attempt=None) -> int:
    """The lines ``rank`` printed (in ``attempt``, or in the attempt where it printed most)."""
    return max([e.get("lines", 0) for e in job.every("step") + job.every("exit")
                if e["rank"] == rank and attempt in (None, e["attempt"])] or [0])


def what_ranks_did(job) -> str:
    """A few lines per rank and attempt: the summary a failure message ends with."""
    lines = []
    for rank, attempt in sorted(job.events):
        run, events = Run(job.of(rank, attempt)), job.of(rank, attempt)
        if not run.steps and not run.pending:
            joined = " and joined the process group" if any(e["kind"] == "init" for e in events) else ""
            lines.append(f"  rank {rank}, attempt {attempt}: started{joined}, trained nothing")
            continue
        init = [e for e in events if e["kind"] == "init"]
        micro = [len(ids) for step in run.steps for ids in step["micro"]]
        writes = sorted({Path(e["path"]).name for e in events if e["kind"] == "save" and e["path"]})
        lines.append(
            f"  rank {rank} (LOCAL_RANK {events[0]['local_rank']}), attempt {attempt}: "
            + (f"process group {init[0]['backend'] or 'default'}" if init else "no process group")
            + f"; {len(run.steps)} optimizer steps from {len(micro)} forwards"
            + (f" of {min(micro)}-{max(micro)} samples" if micro else "")
            + (f", {sorted({s['syncs'] for s in run.steps})} all-reduce(s) per step" if run.steps else "")
            + f"; {len(run.evaluations)} evaluation(s) of {[len(e['ids']) for e in run.evaluations]} samples"
            + (f"; saved {writes}" if writes else "")
            + f"; printed {_lines_printed(job, rank, attempt)} lines")
    return "What your ranks did:\n" + "\n".join(lines) if lines else "No rank recorded anything."


def _fail(job, message):
    raise CheckFailed(f"{message}\n\n{what_ranks_did(job)}")


# --- 0. before any rank starts ----------------------------------------------------------------


def _preflight(source):
    from ..exercises import STUB  # here, not at the top: it imports nbformat, which notebooks need not load
    stubs = [n for n, line in enumerate(source.splitlines(), 1) if line.strip() == STUB]
    if stubs:
        raise CheckFailed(f"line {stubs[0]} still raises NotImplementedError: that is where your job "
                          "starts. Delete it and turn the script below it into a torchrun job (no rank "
                          "was started).")
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "spike_course" or n.startswith("spike_course.") for n in names):
            raise CheckFailed("your script imports spike_course, which the cluster does not have: the "
                              "job must need torch only (no rank was started).")


# --- 1. it ran, and joined a group ------------------------------------------------------------


def _first_traceback(output) -> str:
    """The first rank traceback that is not the check's own crash nor an echo of another rank's."""
    output = re.sub(r"^\[(?:default)?rank\d+\]:", "", output, flags=re.M)  # torchrun's prefixes
    blocks = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*\S.*", output)
    own = [b for b in blocks if "crashed rank" not in b and "closed by peer" not in b]
    return (own or blocks or [output.strip()[-1500:]])[0]


def _joined(job):
    alone = [rank for rank, attempt in sorted(job.events)  # ranks that worked, but in no group
             if attempt == 0 and job.of(rank, 0) and not job.of(rank, 0, "init")]
    if alone:
        _fail(job, f"ranks {alone} never called init_process_group: the script is still one process "
                   "per copy, and each copy trains alone (hint 1).")


def _ran(job):
    if job.timed_out:
        _fail(job, f"your job ran for more than {capstone_run.LAUNCH_TIMEOUT} s on {TRAIN_SAMPLES} samples "
                   "and was stopped: a rank most likely waits in a collective (all_reduce, barrier) that "
                   "another rank never reaches, e.g. one inside `if rank == 0:` (hint 2).")
    if any(code != 0 for code in job.returncodes):
        error = _first_traceback(job.output)
        if "RendezvousTimeoutError" in job.output and 1 in job.attempts:
            _fail(job, f"after the check crashed rank {CRASH_RANK}, torchrun could not restart the job: the "
                       "other node's rank had already finished, so it never waited for rank "
                       f"{CRASH_RANK} in a collective. Do the ranks all-reduce their gradients (hint 2)?")
        if "mutually exclusive with shuffle" in error:
            _fail(job, "DataLoader refused sampler= together with shuffle=True: the sampler decides the "
                       "order now (hint 1).")
        _fail(job, f"your job failed under torchrun. The first error of a rank:\n{error[-2500:]}")


def _one_saver(job):
    for event in job.every("save"):
        if event["rank"] != 0:
            # With one process per node, every rank is LOCAL_RANK 0: both conditions read alike here.
            _fail(job, f"rank {event['rank']}, LOCAL_RANK {event['local_rank']} of the second node, wrote "
                       f"{Path(event['path']).name} too: one process of the whole job writes, RANK 0 (not "
                       "every rank, and not LOCAL_RANK 0, which exists on every node). Two writers of one "
                       "file on the shared volume corrupt it (hint 3).")


def _one_metrics_writer(job):
    metrics = str(job.folder / "metrics.jsonl")
    writers = sorted({e["rank"] for e in job.every("open") if e["path"] == metrics and e["rank"] != 0})
    if writers:
        _fail(job, f"rank(s) {writers} also appended to the metrics log, so every line appears once per "
                   "rank: only rank 0 logs (hint 3).")


def _one_printer(job):
    talkers = sorted({rank for rank, _ in job.events if rank != 0 and _lines_printed(job, rank) > 0})
    if talkers:
        _fail(job, f"rank(s) {talkers} printed {_lines_printed(job, talkers[0])} lines: on a node of 8 GPUs "
                   "every log line would appear 8 times (16 on two nodes). Print on rank 0 only (hint 3).")


ONE_WRITER = (_one_saver, _one_metrics_writer, _one_printer)


# --- 2. training: the data, the batch, the gradients, the schedule -----------------------------


def _own_part_of_the_data(job, runs):
    epoch0 = {r: runs[r].samples(runs[r].epoch(0)) for r in range(WORLD)}
    shared = set(epoch0[0]).intersection(*map(set, list(epoch0.values())[1:]))
    if shared:
        _fail(job, f"in epoch 0 the ranks trained on the same samples ({len(shared)} of them, e.g. sample "
                   f"{min(shared)} on every rank): each rank repeats the others' work instead of taking "
                   "its own part of the data (hint 1).")
    covered = set().union(*map(set, epoch0.values()))
    if len(covered) != TRAIN_SAMPLES:
        _fail(job, f"epoch 0 trained on {len(covered)} of the {TRAIN_SAMPLES} training samples (the "
                   "ranks' parts together should be the whole data set, once).")


def _global_batch(job, runs):
    sizes = [[max(map(len, s["micro"]), default=0) for s in runs[r].steps] for r in range(WORLD)]
    largest = max(max(s, default=0) for s in sizes)
    if largest > MICRO_BATCH:
        _fail(job, f"a forward pass took {largest} samples, more than --micro-batch {MICRO_BATCH}: that "
                   "is what fits in a GPU's memory, so keep it and change the accumulation (hint 2).")
    for step in range(min(len(runs[r].steps) for r in range(WORLD))):
        total = sum(len(runs[r].samples([runs[r].steps[step]])) for r in range(WORLD))
        if total != GLOBAL_BATCH:
            grown = " It grew with the number of ranks, at the same learning rate." if total == GLOBAL_BATCH * WORLD else ""
            _fail(job, f"optimizer step {step} was computed from {total} samples over the {WORLD} ranks, but "
                       f"--batch-size is {GLOBAL_BATCH} samples per optimizer step, the batch the learning "
                       f"rate was tuned for.{grown} Keep the global batch whatever the world size (hint 2).")


def _same_start_and_train_mode(job, runs):
    import torch

    first = job.weights(0, 0)
    for rank in range(1, WORLD):
        theirs = job.weights(rank, 0)
        if first is not None and theirs is not None and any(not torch.equal(first[k], theirs[k]) for k in first):
            _fail(job, f"rank {rank} started from other initial weights than rank 0: the ranks train "
                       "different models (hint 2).")
    for rank, attempt in job.events:
        if any(e["kind"] == "forward" and e["grad"] and not e["training"] for e in job.of(rank, attempt)):
            _fail(job, f"rank {rank} ran training forwards in eval mode: after the first evaluation the "
                       "model was never put back in train mode (dropout and normalisation layers behave "
                       "differently in eval mode).")


def _one_allreduce_per_step(job, runs):
    syncs = sorted({s["syncs"] for r in range(WORLD) for s in runs[r].steps})
    if syncs == [0]:
        _fail(job, "no gradient was all-reduced: each rank stepped with its own gradients, so the "
                   "models drift apart. Train through the model wrapped for data parallelism, not the "
                   "plain one (hint 2).")
    if syncs != [1]:
        accumulated = len(runs[0].steps[0]["micro"])
        _fail(job, f"DDP all-reduced the gradients {max(syncs)} times per optimizer step, once per micro-"
                   f"batch ({accumulated} per rank): on a DGX node that is {accumulated}x the traffic for "
                   "the same result. All-reduce once, on the last micro-batch of each step (hint 2).")


def _schedule(job, runs):
    for step, event in enumerate(runs[0].steps):
        if not math.isclose(event["lr"], _learning_rate(step), rel_tol=1e-12):
            horizons = [t for t in range(1, 20 * STEPS_PER_EPOCH)
                        if all(math.isclose(e["lr"], _learning_rate(s, t), rel_tol=1e-12)
                               for s, e in enumerate(runs[0].steps))]
            if horizons:
                _fail(job, f"the cosine decays over {horizons[0]} optimizer steps, but the job makes "
                           f"{EPOCHS * STEPS_PER_EPOCH} ({STEPS_PER_EPOCH} per epoch): count the steps of an "
                           "epoch as a rank makes them now (hint 2).")
            _fail(job, f"the learning rate of optimizer step {step} is {event['lr']:.6g}; the one-GPU script "
                       f"uses {_learning_rate(step):.6g} there (its warm-up and cosine over "
                       f"{EPOCHS * STEPS_PER_EPOCH} steps).")


# --- 3. the checkpoint ------------------------------------------------------------------------


def _checkpoint_written(job, checkpoint):
    """The checkpoint rank 0 left, with plain keys and all a resume needs."""
    if not checkpoint.exists():
        _fail(job, f"no checkpoint at --checkpoint {checkpoint.name}: rank 0 must write it every epoch.")
    state = _plain_keys(job, checkpoint)
    missing = [k for k in ("model", "optimizer", "scheduler") if k not in state]
    if missing:
        _fail(job, f"the checkpoint lacks {missing}: a resumed run needs them to continue exactly.")
    return state


def _checkpoint_atomic(job, checkpoint):
    if any(e["path"] == str(checkpoint) for e in job.every("save")):
        _fail(job, "torch.save wrote straight to the checkpoint's path: a crash or a preemption in the "
                   "middle leaves half a file and loses the previous checkpoint too (hint 3).")
    if not any(e["dst"] == str(checkpoint) for e in job.every("rename")):
        _fail(job, "the checkpoint was put in place without a rename (a copy, or a write to its path): "
                   "only a rename on the same file system is atomic, so a crash can leave half a "
                   "checkpoint (hint 3).")


def _plain_keys(job, checkpoint):
    """The checkpoint (None if there is none yet), once its model's keys are the plain model's."""
    import torch

    state = torch.load(checkpoint) if checkpoint.exists() else None
    model = state.get("model", {}) if isinstance(state, dict) else {}
    if any(k.startswith("module.") for k in model):
        _fail(job, f"the checkpoint's model keys start with 'module.' ({next(iter(model))!r}): that is the "
                   "DDP wrapper's state_dict, which a plain model cannot load (hint 3).")
    return state


def _others_waited(job):
    for save in (e for e in job.every("save") if e["rank"] == 0):
        # Training forwards only: a rank may still be evaluating its part when rank 0 saves, but
        # the next training step is past the point where it should have waited.
        training = [e for e in job.every("forward") if e["grad"]]
        others = [e for e in training + job.every("destroy") + job.every("exit") + job.every("load")
                  if e["rank"] != 0 and e["attempt"] == save["attempt"]]
        # Busy while rank 0 wrote, or gone before it had finished (an exit can come before the
        # save even starts: rank 0 prints and logs first).
        early = [e for e in others if save["start"] < e["time"] < save["time"]
                 or e["kind"] == "exit" and e["time"] < save["time"]]
        if early:
            _fail(job, f"rank {early[0]['rank']} went on ({early[0]['kind']}) while rank 0 was still writing "
                       "the checkpoint: no rank waited for it. A rank that exits, crashes or reads the "
                       "checkpoint meanwhile finds half of it, or none (hint 3).")


# --- 4. the evaluation ------------------------------------------------------------------------


def _each_test_sample_once(job, runs):
    seen = {r: [i - TRAIN_SAMPLES for i in runs[r].evaluations[0]["ids"]] for r in range(WORLD)
            if runs[r].evaluations}
    if len(seen) < WORLD:
        _fail(job, "a rank never evaluated: every rank must take part in the evaluation.")
    if all(sorted(ids) == list(range(TEST_SAMPLES)) for ids in seen.values()):
        _fail(job, f"every rank evaluated the whole test set ({TEST_SAMPLES} samples each): the result is "
                   "right, but the evaluation takes as long on 16 GPUs as on one. Give each rank its own "
                   "part, and add the counts up over the ranks (hint 4).")
    counts = Counter(i for ids in seen.values() for i in ids)
    twice = sorted(i for i, n in counts.items() if n > 1)
    if twice:
        _fail(job, f"test samples {twice[:5]} were evaluated on more than one rank ({sum(counts.values())} "
                   f"evaluations of {TEST_SAMPLES} samples): a DistributedSampler pads the last part with "
                   "repeats, so they count twice (hint 4).")
    if len(counts) != TEST_SAMPLES:
        _fail(job, f"only {len(counts)} of the {TEST_SAMPLES} test samples were evaluated (hint 4).")


def _accuracy(weights, data_path):
    """(correct, ambiguous, correct on each rank's part) of ``weights`` on the test set; a sample
    is ambiguous when its two best logits lie so close that another batch's rounding may swap them."""
    import torch

    _, (x, y) = _tensors(data_path)
    model = _model()
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        logits = model(x)
    top2 = logits.topk(2, dim=1).values
    hit = logits.argmax(dim=1) == y
    return int(hit.sum()), int((top2[:, 0] - top2[:, 1] < 1e-4).sum()), hit


def _reported_accuracy(job, entry, weights, data_path):
    correct, ambiguous, hit = _accuracy(weights, data_path)
    reported = entry.get("test_accuracy")
    if not isinstance(reported, float):
        _fail(job, f"the metrics line {entry} has no test_accuracy.")
    # Two different fractions with denominators <= 202 differ by more than 1e-5; a float
    # division errs by about 1e-16. `ambiguous` samples may legitimately flip.
    if any(abs(reported - (correct + d) / TEST_SAMPLES) < 1e-9 for d in range(-ambiguous, ambiguous + 1)):
        return
    own = [hit[r::WORLD].float().mean().item() for r in range(WORLD)]
    if any(abs(reported - a) < 1e-6 for a in own):
        _fail(job, f"the test accuracy {reported:.4f} is rank 0's own part only (the whole test set gives "
                   f"{correct / TEST_SAMPLES:.4f}): the ranks' counts were never added up (hint 4).")
    _fail(job, f"the test accuracy {reported:.6f} is not the accuracy of the trained weights over the whole "
               f"test set ({correct / TEST_SAMPLES:.6f}) (hint 4).")


# --- 5. the restart ---------------------------------------------------------------------------


def _new_shuffle_every_epoch(job, runs):
    for rank in range(WORLD):
        epoch0, epoch1 = runs[rank].epoch(0), runs[rank].epoch(1)
        if epoch1 and [s["micro"] for s in epoch1] == [s["micro"] for s in epoch0[:len(epoch1)]]:
            _fail(job, f"rank {rank} saw epoch 1 in the same order as epoch 0: the sampler shuffles the "
                       "same way every epoch unless it is told which epoch it is (hint 1).")


def _restarted(job):
    if 1 not in job.attempts:
        _fail(job, f"the job was never restarted: the check crashes rank {CRASH_RANK} after {CRASH_AFTER} "
                   "optimizer steps, and torchrun restarts it. Did the job make that many steps?")


def _loaded(job, checkpoint, before, after):
    for rank in range(WORLD):
        loads = [e for e in job.of(rank, 1, "load") if e["path"] == str(checkpoint)]
        if not loads:
            _fail(job, f"after the restart, rank {rank} did not load {checkpoint.name}: the job started over "
                       "from scratch and lost its work (hint 3).")
        if loads[0]["map_location"] is None:
            _fail(job, "the checkpoint is loaded without map_location: on GPUs torch.load puts every "
                       "tensor back on the GPU that saved it, so all 8 ranks of a node load onto GPU 0 "
                       "(and run out of memory there). Load onto the rank's own device (hint 3).")


def _optimizer_restored(job, checkpoint, before, after):
    first = after[0].steps[0] if after[0].steps else None
    if first is not None and not first["had_state"]:
        _fail(job, "after the restart the optimizer started without its state (AdamW's moments): it "
                   "was not restored from the checkpoint, so the resumed run takes other steps.")


def _scheduler_restored(job, checkpoint, before, after):
    done = len(before[0].epoch(0))
    for i, step in enumerate(after[0].steps):
        if not math.isclose(step["lr"], _learning_rate(done + i), rel_tol=1e-12):
            over = " — the schedule started over" if math.isclose(step["lr"], _learning_rate(i)) else ""
            _fail(job, f"step {i} after the restart used the learning rate {step['lr']:.6g}, but step "
                       f"{done + i} of the schedule is {_learning_rate(done + i):.6g}{over}: the scheduler "
                       "was not restored from the checkpoint (the optimizer's saved learning rate only "
                       "covers the first step).")


def _same_order_after_restart(job, checkpoint, before, after):
    for rank in range(WORLD):
        again, crashed = after[rank].epoch(0), before[rank].epoch(1)
        if [s["micro"] for s in again[:len(crashed)]] != [s["micro"] for s in crashed]:
            _fail(job, f"after the restart rank {rank} saw epoch 1 in another order than before the crash: a "
                       "resumed run must replay the same data (the sampler's seed and epoch decide it).")


RESUMED = (_loaded, _optimizer_restored, _scheduler_restored, _same_order_after_restart)


# --- 6. the weights, replayed -----------------------------------------------------------------


def _replay(weights, steps, data_path, snapshots=()):
    """DDP's arithmetic on the recorded batches: per step, each rank's micro-batch gradients
    accumulated (each loss divided by the number of micro-batches), divided by the world size
    and summed (DDP's all-reduce: for 2 ranks the sum is the same in either order, and halving
    is exact), clipped, then AdamW with the recorded learning rate. One thread, as each rank.
    Returns the weights after each step number in ``snapshots``."""
    import torch
    import torch.nn.functional as F

    from ..runtime import rank_arithmetic

    (x, y), _ = _tensors(data_path)
    model = _model()
    model.load_state_dict(weights)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    taken = []
    with rank_arithmetic(1):
        for number, per_rank in enumerate(steps, 1):
            accumulated = []
            for step in per_rank:
                model.zero_grad(set_to_none=True)
                for ids in step["micro"]:
                    (F.cross_entropy(model(x[ids]), y[ids]) / len(step["micro"])).backward()
                accumulated.append([p.grad / WORLD for p in params])
            for p, *grads in zip(params, *accumulated):
                p.grad = grads[0]
                for g in grads[1:]:
                    p.grad = p.grad + g
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            for group in optimizer.param_groups:
                group["lr"] = per_rank[0]["lr"]
            optimizer.step()
            if number in snapshots:
                taken.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return taken


def _difference(a, b):
    return max(((a[k].double() - b[k].double()).abs().max().item(), k) for k in b)


def _weights_match(job, before, after, state, data):
    """Epoch 0 as attempt 0 trained it, then epoch 1 as the restarted attempt did: the weights
    the restart loaded, and the final ones, must equal the replay's bit for bit."""
    epoch0 = list(zip(*(before[r].epoch(0) for r in range(WORLD))))
    epoch1 = list(zip(*(after[r].epoch(0) for r in range(WORLD))))
    at_restart, final = _replay(job.weights(0, 0), epoch0 + epoch1, data,
                                snapshots=(len(epoch0), len(epoch0) + len(epoch1)))
    resumed = job.weights(0, 1)
    if resumed is not None and set(resumed) == set(at_restart) and _difference(resumed, at_restart)[0] != 0:
        gap, where = _difference(resumed, at_restart)
        _fail(job, f"after epoch 0 your weights differ by up to {gap:.3g} (in {where}) from DDP's arithmetic "
                   "on your ranks' own batches: each optimizer step's gradient should be the mean over "
                   "its global batch, averaged by the all-reduce and clipped after it (hint 2).")
    gap, where = _difference(state["model"], final)
    if gap != 0:
        _fail(job, f"epoch 0 matched, but after the restart the final weights differ by up to {gap:.3g} "
                   f"(in {where}) from DDP's arithmetic on your ranks' batches: the resumed run does not "
                   "continue exactly.")
    return at_restart, final


def _metrics_logged(job, folder, weights, data):
    epoch0, final = weights
    path = folder / "metrics.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if len(entries) != EPOCHS:
        _fail(job, f"rank 0 logged {len(entries)} evaluations to --metrics, for {EPOCHS} epochs with a restart "
                   "in between: one line per epoch, none repeated.")
    _reported_accuracy(job, entries[0], epoch0, data)
    _reported_accuracy(job, entries[1], final, data)


def _closed(job):
    last = max(job.attempts)
    missing = [r for r in range(WORLD) if not job.of(r, last, "destroy")]
    if missing:
        _fail(job, f"ranks {missing} never called destroy_process_group: a rank that leaves without it "
                   "can hang or abort its exit, and its neighbours see a crash.")


# --- 7. on nodes with GPUs ----------------------------------------------------------------------

# The pretend GPU start: each node as if it had one GPU for its two processes, as a node does
# where a job asks for fewer GPUs than processes (a Run:ai GPU fraction). RANK and LOCAL_RANK
# still differ on the second node, and LOCAL_RANK alone would ask for a GPU that is not there.
PRETEND_GPUS, PRETEND_PER_NODE = 1, 2
PICKED_BY = {"set_device": "torch.cuda.set_device", "to": "the model's .to", "ddp": "DDP's device_ids"}


def pretend_gpus(script, folder, options, data):
    """Start the job on pretend GPUs: what each rank chooses is recorded, and the ranks leave
    once the model is wrapped in DDP."""
    return capstone_run.launch(script, folder, options, data=data, per_node=PRETEND_PER_NODE,
                               probe_env={"CAPSTONE_FAKE_GPUS": str(PRETEND_GPUS)})


def _picks(events) -> list[tuple[str, str]]:
    """(how, which GPU) for each GPU the rank chose: set_device, the model's .to, DDP's device_ids."""
    picks = [(e["kind"], e["index"]) for e in events if e["kind"] in ("set_device", "to")]
    picks += [("ddp", d) for e in events if e["kind"] == "ddp" and isinstance(e["device_ids"], list)
              for d in e["device_ids"]]
    return [(kind, str(index).split(":")[-1]) for kind, index in picks if index is not None]


def _local_ranks(job) -> dict[int, int]:
    ranks = range(capstone_run.NODES * job.per_node)
    return {r: job.of(r, 0)[0]["local_rank"] if job.of(r, 0) else r % job.per_node for r in ranks}


def _gpu_backend(job):
    for rank in _local_ranks(job):
        init = job.of(rank, 0, "init")
        if init and init[0]["backend"] not in (None, "nccl") and "nccl" not in (init[0]["backend"] or ""):
            _fail(job, f"on a node with GPUs rank {rank} still starts the {init[0]['backend']} backend: "
                       "gloo moves every gradient through the CPU; NCCL uses NVLink (hint 1).")


def _gpu_picked(job):
    """Which GPU each choice named: LOCAL_RANK's, shared where the node has fewer GPUs."""
    local = _local_ranks(job)
    for rank in local:  # RANK first: it is the likelier cause of a GPU that is not there
        for kind, index in _picks(job.of(rank, 0)):
            if index == str(rank) != str(local[rank]):
                _fail(job, f"rank {rank} is LOCAL_RANK {local[rank]} on its node, but {PICKED_BY[kind]} got GPU "
                           f"{index}: RANK counts over all nodes (8-15 on the second DGX node), a node's GPUs are "
                           "numbered by LOCAL_RANK (hint 1).")
    for rank in local:
        for kind, index in _picks(job.of(rank, 0)):
            if index.isdigit() and int(index) >= PRETEND_GPUS:
                _fail(job, f"rank {rank} (LOCAL_RANK {local[rank]}) runs on a node with {PRETEND_GPUS} GPU for "
                           f"{job.per_node} processes, as under a Run:ai GPU fraction, and {PICKED_BY[kind]} asked "
                           f"for GPU {index}, which that node does not have: with fewer GPUs than processes, the "
                           "processes share them (hint 1).")
            if index != str(local[rank] % PRETEND_GPUS):
                _fail(job, f"rank {rank} is LOCAL_RANK {local[rank]} on a node of {PRETEND_GPUS} GPU, but "
                           f"{PICKED_BY[kind]} got GPU {index}: a node's GPUs are numbered by LOCAL_RANK (hint 1).")


def _gpu_set_device(job):
    for rank in _local_ranks(job):
        if not job.of(rank, 0, "set_device"):
            _fail(job, f"rank {rank} never called torch.cuda.set_device: whatever is made on 'cuda' without "
                       "an index (NCCL's own buffers too) lands on GPU 0, so 8 ranks share it (hint 1).")


def _gpu_device_ids(job):
    for rank in _local_ranks(job):
        ddp = job.of(rank, 0, "ddp")
        if ddp and ddp[0]["device_ids"] is not None and not isinstance(ddp[0]["device_ids"], list):
            _fail(job, f"device_ids={ddp[0]['device_ids']} is not a list: DDP wants the list of the one GPU "
                       "this process uses (hint 1).")


def _gpu_job_wrapped(job):
    if any(code != 0 for code in job.returncodes) or not job.every("ddp"):
        _fail(job, "on a node with a GPU, your job failed before it wrapped the model in DDP. The first "
                   f"error of a rank:\n{_first_traceback(job.output)[-2500:]}")


GPU_CHOICES = (_gpu_backend, _gpu_picked, _gpu_set_device, _gpu_device_ids, _gpu_job_wrapped)


# --- the check -------------------------------------------------------------------------------


class _Judge:
    """Runs the check's steps in order. For a learner the first step that fails ends the check
    (CheckFailed). Collecting, every step runs and each failure is kept: the tests plant several
    mistakes that different steps see in one script, and one launch names them all. A step
    that needs what a failed step would have given is skipped."""

    def __init__(self, collect=False):
        self.collect, self.failures = collect, []

    def __call__(self, step, *args):
        if any(arg is _FAILED for arg in args):
            return _FAILED
        try:
            return step(*args)
        except Exception as failure:  # collecting, a step an earlier mistake left blind says so
            if not self.collect:
                raise
            self.failures.append(str(failure) if isinstance(failure, CheckFailed) else
                                 f"{step.__name__} could not judge: {failure!r}")
            return _FAILED


_FAILED = object()  # what a failed step gave, when the judge collects


def _first_attempt(job, checkpoint, judge):
    """Everything the first attempt shows, in the order of the hints: the data, the batch and
    the gradients (1, 2), the writer and the checkpoint (3), the evaluation (4). Returns the
    checkpoint as it is now."""
    _joined(job)
    before = _runs(job, 0)
    for step in (_own_part_of_the_data, _global_batch, _same_start_and_train_mode, _one_allreduce_per_step,
                 _schedule):
        judge(step, job, before)
    for step in ONE_WRITER:
        judge(step, job)
    state = judge(_checkpoint_written, job, checkpoint)
    judge(_checkpoint_atomic, job, checkpoint)
    judge(_others_waited, job)
    judge(_each_test_sample_once, job, before)
    judge(_new_shuffle_every_epoch, job, before)
    return state


def _first_attempt_over(job, rank) -> bool:
    """Whether ``rank`` has recorded all it will of attempt 0: it crashed or exited (the
    planned crash makes the other rank's collective fail), or its restart has begun (a rank
    killed outright records no exit)."""
    return bool(job.of(rank, 0, "crash") or job.of(rank, 0, "exit")) or (rank, 1) in job.events


def _gpu_choices(job, judge):
    """The choices recorded on pretend GPUs: NCCL, and on each node GPU LOCAL_RANK % its GPUs."""
    for step in GPU_CHOICES:
        judge(step, job)


class _FirstAttemptJudged(Exception):
    """Stops a job once its first attempt is judged, when that is all that was asked for."""


class _FailedByItself(Exception):
    """Stops a job that torchrun restarts although the check never crashed it: its first attempt
    failed by itself, and the restart would only fail again the same way (and take as long)."""

    def __init__(self, job):
        super().__init__()
        self.job = job


def _judged(script, folder, judge, first_attempt_only=False):
    """Run the job (crashed once, restarted), judge what its ranks did step by step, then
    start it on pretend GPUs and judge its choices there (or judge the first attempt only)."""
    script, folder = Path(script).resolve(), (Path(folder) / "capstone_check").resolve()
    if not script.exists():
        raise CheckFailed(f"{script} does not exist: run its %%writefile cell first.")
    _preflight(script.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    data, checkpoint, metrics = folder / "data.pt", folder / "checkpoint.pt", folder / "metrics.jsonl"
    for old in [metrics, *folder.glob("checkpoint.pt*")]:
        old.unlink(missing_ok=True)
    _write_data(data)
    options = _options(data, checkpoint, metrics)

    judged = []

    def watch(job):  # attempt 0's mistakes are named as soon as it is over, not after the restart
        if not judged and not job.of(CRASH_RANK, 0, "crash") and any((r, 1) in job.events for r in range(WORLD)):
            raise _FailedByItself(job)
        if not judged and job.of(CRASH_RANK, 0, "crash") and all(_first_attempt_over(job, r) for r in range(WORLD)):
            judged.append(True)
            _first_attempt(job, checkpoint, judge)
            if first_attempt_only:
                raise _FirstAttemptJudged

    try:
        job = capstone_run.launch(script, folder, options, data=data, max_restarts=1,
                                  watch=None if judge.collect and not first_attempt_only else watch,
                                  probe_env={"CAPSTONE_CRASH": f"{CRASH_RANK}:{CRASH_AFTER}",
                                             "CAPSTONE_SAVE_DELAY": str(SAVE_DELAY)})
    except _FirstAttemptJudged:
        return
    except _FailedByItself as stopped:
        job = stopped.job
    _joined(job)
    if job.timed_out or any(code != 0 for code in job.returncodes):
        for step in ONE_WRITER:  # two writers of one file often make the job fail: name the cause
            step(job)
        _plain_keys(job, checkpoint)  # so do 'module.' keys, when the restart loads them
        _ran(job)
    state = _first_attempt(job, checkpoint, judge)
    if first_attempt_only:
        return
    before, after = _runs(job, 0), _runs(job, 1)
    _restarted(job)
    for step in RESUMED:
        judge(step, job, checkpoint, before, after)
    weights = judge(_weights_match, job, before, after, state, data)
    judge(_metrics_logged, job, folder, weights, data)
    judge(_closed, job)
    _gpu_choices(pretend_gpus(script, folder, options, data), judge)


def check_capstone_job(script, folder) -> None:
    """Run the learner's ``script`` as a 2-node torchrun job (crashed once, restarted), judge
    what its ranks did step by step, then record its choices on pretend GPUs."""
    _judged(script, folder, _Judge())
    passed(f"your job ran as 2 nodes under bare torchrun: each rank trained on its own part with a "
           f"global batch of {GLOBAL_BATCH} and one all-reduce per optimizer step, rank 0 alone logged and "
           f"wrote the checkpoint (atomically, waited for), each of the {TEST_SAMPLES} test samples was "
           f"counted once, the job crashed, restarted and resumed exactly, its weights equal DDP's "
           "arithmetic on its batches bit for bit, and on GPUs it would choose NCCL and LOCAL_RANK's GPU, "
           "shared where a node has fewer GPUs than processes")


def capstone_job_mistakes(script, folder, first_attempt_only=False) -> list[str]:
    """What the check says of every step that fails for ``script``, not only the first (in the
    check's order): the tests plant several mistakes in one script and launch it once. With
    ``first_attempt_only`` the job stops once its first attempt is judged, as it does for a
    learner whose first attempt shows a mistake."""
    judge = _Judge(collect=True)
    _judged(script, folder, judge, first_attempt_only)
    return judge.failures


def check_capstone_submit(line: str, script: str = "train.py", nodes: int = 2,
                          gpus_per_node: int = 8) -> None:
    """The Run:ai line runs ``script`` on ``nodes`` DGX nodes with all their GPUs, from the
    cluster's facts: its pods and GPUs, each pod's command, the image, resources and environment."""
    if not isinstance(line, str) or not line.startswith("runai "):
        raise CheckFailed(f"expected the runai command line as a string, got {line!r}: build it with "
                          "spike_course.runai.submit_command(...).")
    words = shlex.split(line)
    command = " ".join(words[words.index("--") + 1:]) if "--" in words else ""
    _pods_and_gpus(words, nodes, gpus_per_node)
    _pod_command(command, script, gpus_per_node)
    _image_resources_environment(words)
    _rehearsed(line)
    if _value(words, "--existing-pvc") is None or "/data" not in command:
        raise CheckFailed("mount the team's volume (pvc=...) and keep the script and --checkpoint "
                          "on it (cd /data/...): a pod's own disk disappears with the pod, and with "
                          "it the checkpoint a restarted job needs.")
    passed(f"`runai training pytorch submit` with {nodes} pods of {gpus_per_node} GPUs, each "
           f"running torchrun on {script}; rehearsed under both operator releases, the pods meet "
           "and a SIGTERM reaches torchrun")


def _value(words, flag):
    return words[words.index(flag) + 1] if flag in words else None


def _pods_and_gpus(words, nodes, gpus_per_node):
    if words[1:4] != ["training", "pytorch", "submit"]:
        raise CheckFailed("this is not a distributed PyTorch workload: `runai training submit` makes "
                          "ONE pod. Pass workers=... to submit_command for `runai training pytorch "
                          "submit`, so the training operator starts the pods and their rendezvous.")
    master = "--no-master" not in words  # Run:ai adds a master pod, which trains too, unless told not to
    pods = int(_value(words, "--workers")) + master
    if pods != nodes:
        raise CheckFailed(f"this line asks for {pods} pods ({_value(words, '--workers')} workers"
                          + (" and the master pod Run:ai adds" if master else ", no master") +
                          f"), each a whole DGX node, but the job should use {nodes} nodes: count every "
                          "pod that trains.")
    if _value(words, "--gpu-devices-request") != str(gpus_per_node):
        raise CheckFailed(f"--gpu-devices-request is {_value(words, '--gpu-devices-request')}: a pod is one "
                          f"node here, so ask for all its {gpus_per_node} GPUs (gpus={gpus_per_node}).")


def _pod_command(command, script, gpus_per_node):
    if "torchrun" not in command and "torch.distributed.run" not in command:
        raise CheckFailed("the pod's command does not start torchrun: plain python starts one process, "
                          "but the script reads RANK/LOCAL_RANK that torchrun sets, one per GPU.")
    if "--standalone" in command:
        raise CheckFailed("--standalone makes every pod a job of its own (a private rendezvous on "
                          "localhost): leave it out, torchrun reads the shared rendezvous from the "
                          "PET_* variables the operator injects.")
    per_node = [w for w in shlex.split(command) if w.startswith("--nproc-per-node")]
    if not per_node or per_node[0].split("=")[-1] not in (str(gpus_per_node), "gpu"):
        raise CheckFailed(f"torchrun should start one process per GPU, --nproc-per-node={gpus_per_node} "
                          f"(or gpu), got {per_node or 'none'}.")
    if script not in command:
        raise CheckFailed(f"the command does not run {script}.")


def _rehearsed(line):
    """Each pod's command, read as the cluster runs it (chapter 07, section 7.6), under both
    operator releases: the first mistake the rehearsal names is the learner's."""
    from .. import rehearsal
    from ..rehearsal.findings import LINE, seen

    for flavour in ("older", "newer"):
        mistakes = seen(LINE, rehearsal.read(line, flavour))
        if mistakes:
            name, message = mistakes[0]
            raise CheckFailed(f"rehearsed as the cluster would run it (an {flavour} training operator): "
                              f"{message} [{name}]")


def _image_resources_environment(words):
    image = _value(words, "-i") or ""
    host = image.split("/")[0]
    if "/" not in image or "." not in host and ":" not in host:
        raise CheckFailed(f"the image {image!r} names no registry: Run:ai would pull it from Docker Hub, "
                          "where the team's image is not. Give it whole: registry host, project, image.")
    memory = _value(words, "--cpu-memory-request")
    if memory is None or not memory[-1].isalpha():
        raise CheckFailed(f"the memory request is {memory!r}: a Kubernetes quantity without a unit counts "
                          "bytes. Ask with a unit (G, Gi).")
    environment = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "-e"]
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in environment:
        raise CheckFailed("the pods' environment does not give a restarted round its own rendezvous store "
                          "(chapter 07): by default the restarted workers share the previous round's store, "
                          "can read the dead workers' addresses, and fail instead of resuming.")
