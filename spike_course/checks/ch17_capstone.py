"""Exercise checks for the capstone: a group's one-GPU script, converted by the learner into
a torchrun job that needs nothing but torch.

:func:`check_capstone_job` runs the learner's file as a cluster would: under bare torchrun,
as two nodes of one rank each (so RANK and LOCAL_RANK differ on the second), in a Python
where ``spike_course`` cannot be imported (``spike_course.lab.two_node_job``). Rank 1 is crashed once in the
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

from ..lab import two_node_job
from ._common import CheckFailed, Mistake, name_the_first, passed

# The job the check runs: small enough for seconds on 2 CPU cores. TEST_SAMPLES is odd: a
# DistributedSampler pads 201 samples to 2 x 101, so padded shards count a sample twice.
TRAIN_SAMPLES, TEST_SAMPLES, WORLD = 256, 201, two_node_job.NODES
GLOBAL_BATCH, MICRO_BATCH, EPOCHS = 32, 8, 2
STEPS_PER_EPOCH = TRAIN_SAMPLES // GLOBAL_BATCH
LR, WEIGHT_DECAY, WARMUP_STEPS, CLIP, SEED = 2e-3, 0.05, 4, 1.0, 0
CRASH_RANK, CRASH_AFTER = 1, STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2  # in epoch 1, after epoch 0's save
SAVE_DELAY = 0.5  # rank 0 lingers in torch.save this long: a rank that goes on did not wait
LOADER_WORKERS = 1  # loading in a worker process, as on a cluster (the script's default is 4): one is enough to run that path


def _options(data, checkpoint, metrics):
    return ["--data", data, "--epochs", EPOCHS, "--batch-size", GLOBAL_BATCH, "--micro-batch", MICRO_BATCH,
            "--lr", LR, "--weight-decay", WEIGHT_DECAY, "--warmup-steps", WARMUP_STEPS, "--clip", CLIP,
            "--seed", SEED, "--workers", LOADER_WORKERS, "--log-every", 4, "--checkpoint", checkpoint,
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
    """A failure no table names (a crash, a job that did not run as asked), with what the ranks did."""
    raise CheckFailed(f"{message}\n\n{what_ranks_did(job)}")


def _judge_table(mistakes, job, *readings):
    """Fail with the first of ``mistakes`` that ``job`` (and ``readings``) show, followed by what
    the ranks did."""
    name_the_first(mistakes, job, *readings, after=lambda: f"\n\n{what_ranks_did(job)}")


# --- 0. before any rank starts ----------------------------------------------------------------


def _preflight(source):
    from ..course.conventions import stub_lines
    stubs = stub_lines(source)
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


_TRACEBACK = re.compile(r"Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*\S.*")


def _first_traceback(job) -> str:
    """The traceback of the rank the launch names as failed (``LaunchResult.failure``, the one
    reading of a failure), or of the first rank with one, that is not the check's own crash nor
    an echo of another rank's."""
    failure, output = job.result.failure, job.result.output
    for rank in ([failure.rank] if failure and failure.rank is not None else []) + sorted(output):
        blocks = _TRACEBACK.findall("\n".join(output.get(rank, [])) + "\n")
        own = [b for b in blocks if "crashed rank" not in b and "closed by peer" not in b]
        if own:
            return own[0]
    return job.output.strip()[-1500:]


def _alone(job) -> list[int]:
    """The ranks that worked in attempt 0, but in no process group."""
    return [rank for rank, attempt in sorted(job.events) if attempt == 0 and job.of(rank, 0)
            and not job.of(rank, 0, "init")]


NEVER_JOINED = Mistake(
    "never joined a process group", lambda job: bool(_alone(job)),
    lambda job: f"ranks {_alone(job)} never called init_process_group: the script is still one process per copy, "
                "and each copy trains alone (hint 1).")


def _joined(job):
    _judge_table((NEVER_JOINED,), job)


# A job that did not run to its end (readings: the job, its first rank traceback).
RAN_MISTAKES = (
    Mistake("a rank waits for ever", lambda job, error: job.timed_out,
            lambda job, error: f"your job ran for more than {two_node_job.LAUNCH_TIMEOUT} s on {TRAIN_SAMPLES} "
                               "samples and was stopped: a rank most likely waits in a collective (all_reduce, "
                               "barrier) that another rank never reaches, e.g. one inside `if rank == 0:` (hint 2)."),
    Mistake("sampler and shuffle", lambda job, error: "mutually exclusive with shuffle" in error,
            "DataLoader refused sampler= together with shuffle=True: the sampler decides the order now (hint 1)."),
)


def _ran(job):
    error = _first_traceback(job)
    _judge_table(RAN_MISTAKES, job, error)
    if "RendezvousTimeoutError" in job.output and 1 in job.attempts:
        _fail(job, f"after the check crashed rank {CRASH_RANK}, torchrun could not restart the job: the "
                   "other node's rank had already finished, so it never waited for rank "
                   f"{CRASH_RANK} in a collective. Do the ranks all-reduce their gradients (hint 2)?")
    _fail(job, f"your job failed under torchrun. The first error of a rank:\n{error[-2500:]}")


def _other_saver(job):
    """The first save by another rank than 0, or None."""
    return next((event for event in job.every("save") if event["rank"] != 0), None)


def _metrics_writers(job) -> list[int]:
    metrics = str(job.folder / "metrics.jsonl")
    return sorted({e["rank"] for e in job.every("open") if e["path"] == metrics and e["rank"] != 0})


def _talkers(job) -> list[int]:
    return sorted({rank for rank, _ in job.events if rank != 0 and _lines_printed(job, rank) > 0})


# One process of the whole job writes, logs and prints (readings: the job). With one process
# per node every rank is LOCAL_RANK 0: a writer per rank and a writer per node read alike here.
MORE_THAN_ONE_WRITER = Mistake(
    "more than one writer", lambda job: _other_saver(job) is not None,
    lambda job: f"rank {_other_saver(job)['rank']}, LOCAL_RANK {_other_saver(job)['local_rank']} of the second node, "
                f"wrote {Path(_other_saver(job)['path']).name} too: one process of the whole job writes, RANK 0 (not "
                "every rank, and not LOCAL_RANK 0, which exists on every node). Two writers of one file on the "
                "shared volume corrupt it (hint 3).")
EVERY_RANK_LOGS = Mistake(
    "every rank logs metrics", lambda job: bool(_metrics_writers(job)),
    lambda job: f"rank(s) {_metrics_writers(job)} also appended to the metrics log, so every line appears once per "
                "rank: only rank 0 logs (hint 3).")
EVERY_RANK_PRINTS = Mistake(
    "every rank prints", lambda job: bool(_talkers(job)),
    lambda job: f"rank(s) {_talkers(job)} printed {_lines_printed(job, _talkers(job)[0])} lines: on a node of 8 GPUs "
                "every log line would appear 8 times (16 on two nodes). Print on rank 0 only (hint 3).")


def _one_saver(job):
    _judge_table((MORE_THAN_ONE_WRITER,), job)


def _one_metrics_writer(job):
    _judge_table((EVERY_RANK_LOGS,), job)


def _one_printer(job):
    _judge_table((EVERY_RANK_PRINTS,), job)


ONE_WRITER = (_one_saver, _one_metrics_writer, _one_printer)


# --- 2. training: the data, the batch, the gradients, the schedule -----------------------------


def _shared(runs) -> set:
    """The samples every rank trained in epoch 0."""
    epoch0 = [set(runs[r].samples(runs[r].epoch(0))) for r in range(WORLD)]
    return epoch0[0].intersection(*epoch0[1:])


NO_SAMPLER = Mistake(
    "no sampler", lambda job, runs: bool(_shared(runs)),
    lambda job, runs: f"in epoch 0 the ranks trained on the same samples ({len(_shared(runs))} of them, e.g. sample "
                      f"{min(_shared(runs))} on every rank): each rank repeats the others' work instead of taking its "
                      "own part of the data (hint 1).")


def _own_part_of_the_data(job, runs):
    _judge_table((NO_SAMPLER,), job, runs)
    covered = set().union(*(set(runs[r].samples(runs[r].epoch(0))) for r in range(WORLD)))
    if len(covered) != TRAIN_SAMPLES:
        _fail(job, f"epoch 0 trained on {len(covered)} of the {TRAIN_SAMPLES} training samples (the "
                   "ranks' parts together should be the whole data set, once).")


def _largest_forward(runs) -> int:
    return max((max(map(len, s["micro"]), default=0) for r in range(WORLD) for s in runs[r].steps), default=0)


def _step_sizes(runs) -> list[int]:
    """The samples of each optimizer step, all ranks together."""
    return [sum(len(runs[r].samples([runs[r].steps[step]])) for r in range(WORLD))
            for step in range(min(len(runs[r].steps) for r in range(WORLD)))]


def _global_batch_off(runs) -> tuple | None:
    """(the first optimizer step whose samples are not the global batch, its samples), or None."""
    return next(((step, total) for step, total in enumerate(_step_sizes(runs)) if total != GLOBAL_BATCH), None)


BATCH_MISTAKES = (
    Mistake("micro-batch grows", lambda job, runs: _largest_forward(runs) > MICRO_BATCH,
            lambda job, runs: f"a forward pass took {_largest_forward(runs)} samples, more than --micro-batch "
                              f"{MICRO_BATCH}: that is what fits in a GPU's memory, so keep it and change the "
                              "accumulation (hint 2)."),
    Mistake("global batch grows", lambda job, runs: _global_batch_off(runs) is not None,
            lambda job, runs: "optimizer step {0} was computed from {1} samples over the {2} ranks, but --batch-size "
                              "is {3} samples per optimizer step, the batch the learning rate was tuned for.{4} Keep "
                              "the global batch whatever the world size (hint 2).".format(
                                  *_global_batch_off(runs), WORLD, GLOBAL_BATCH,
                                  " It grew with the number of ranks, at the same learning rate."
                                  if _global_batch_off(runs)[1] == GLOBAL_BATCH * WORLD else "")),
)


def _global_batch(job, runs):
    _judge_table(BATCH_MISTAKES, job, runs)


def _started_apart(job) -> int | None:
    """The first rank whose initial weights are not rank 0's, or None."""
    import torch

    first = job.weights(0, 0)
    return next((rank for rank in range(1, WORLD) if first is not None and job.weights(rank, 0) is not None
                 and any(not torch.equal(first[k], job.weights(rank, 0)[k]) for k in first)), None)


def _trained_in_eval_mode(job) -> int | None:
    """The first rank that ran a training forward in eval mode, or None."""
    return next((rank for rank, attempt in job.events if any(
        e["kind"] == "forward" and e["grad"] and not e["training"] for e in job.of(rank, attempt))), None)


START_MISTAKES = (
    Mistake("ranks start apart", lambda job, runs: _started_apart(job) is not None,
            lambda job, runs: f"rank {_started_apart(job)} started from other initial weights than rank 0: the ranks "
                              "train different models (hint 2)."),
    Mistake("train mode dropped", lambda job, runs: _trained_in_eval_mode(job) is not None,
            lambda job, runs: f"rank {_trained_in_eval_mode(job)} ran training forwards in eval mode: after the first "
                              "evaluation the model was never put back in train mode (dropout and normalisation layers "
                              "behave differently in eval mode)."),
)


def _same_start_and_train_mode(job, runs):
    _judge_table(START_MISTAKES, job, runs)


def _syncs(runs) -> list[int]:
    """The all-reduces per optimizer step, as many kinds as the steps had."""
    return sorted({s["syncs"] for r in range(WORLD) for s in runs[r].steps})


SYNC_MISTAKES = (
    Mistake("the plain model trained", lambda job, runs: _syncs(runs) == [0],
            "no gradient was all-reduced: each rank stepped with its own gradients, so the models drift apart. "
            "Train through the model wrapped for data parallelism, not the plain one (hint 2)."),
    Mistake("no no_sync", lambda job, runs: _syncs(runs) != [1],
            lambda job, runs: f"DDP all-reduced the gradients {max(_syncs(runs))} times per optimizer step, once per "
                              f"micro-batch ({len(runs[0].steps[0]['micro'])} per rank): on a DGX node that is "
                              f"{len(runs[0].steps[0]['micro'])}x the traffic for the same result. All-reduce once, on "
                              "the last micro-batch of each step (hint 2)."),
)


def _one_allreduce_per_step(job, runs):
    _judge_table(SYNC_MISTAKES, job, runs)


def _horizons(runs) -> list[int]:
    """The numbers of steps a cosine schedule that gives rank 0's learning rates decays over."""
    return [t for t in range(1, 20 * STEPS_PER_EPOCH)
            if all(math.isclose(e["lr"], _learning_rate(s, t), rel_tol=1e-12) for s, e in enumerate(runs[0].steps))]


SCHEDULE_HORIZON = Mistake(
    "schedule's horizon", lambda job, runs: bool(_horizons(runs)),
    lambda job, runs: f"the cosine decays over {_horizons(runs)[0]} optimizer steps, but the job makes "
                      f"{EPOCHS * STEPS_PER_EPOCH} ({STEPS_PER_EPOCH} per epoch): count the steps of an epoch as a "
                      "rank makes them now (hint 2).")


def _schedule(job, runs):
    for step, event in enumerate(runs[0].steps):
        if not math.isclose(event["lr"], _learning_rate(step), rel_tol=1e-12):
            _judge_table((SCHEDULE_HORIZON,), job, runs)
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


# The checkpoint written beside its path and renamed into place (readings: the job, its path).
ATOMIC_MISTAKES = (
    Mistake("written in place", lambda job, checkpoint: any(e["path"] == str(checkpoint) for e in job.every("save")),
            "torch.save wrote straight to the checkpoint's path: a crash or a preemption in the middle leaves half "
            "a file and loses the previous checkpoint too (hint 3)."),
    Mistake("copied, not renamed",
            lambda job, checkpoint: not any(e["dst"] == str(checkpoint) for e in job.every("rename")),
            "the checkpoint was put in place without a rename (a copy, or a write to its path): only a rename on "
            "the same file system is atomic, so a crash can leave half a checkpoint (hint 3)."),
)


def _checkpoint_atomic(job, checkpoint):
    _judge_table(ATOMIC_MISTAKES, job, checkpoint)


def _plain_keys(job, checkpoint):
    """The checkpoint (None if there is none yet), once its model's keys are the plain model's."""
    import torch

    state = torch.load(checkpoint) if checkpoint.exists() else None
    _judge_table((MODULE_KEYS,), job, state.get("model", {}) if isinstance(state, dict) else {})
    return state


MODULE_KEYS = Mistake(
    "module. keys", lambda job, model: any(k.startswith("module.") for k in model),
    lambda job, model: f"the checkpoint's model keys start with 'module.' ({next(iter(model))!r}): that is the DDP "
                       "wrapper's state_dict, which a plain model cannot load (hint 3).")


def _went_on(job) -> dict | None:
    """The first event of another rank while rank 0 was writing a checkpoint, or None."""
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
            return early[0]
    return None


NO_BARRIER = Mistake(
    "no barrier", lambda job: _went_on(job) is not None,
    lambda job: f"rank {_went_on(job)['rank']} went on ({_went_on(job)['kind']}) while rank 0 was still writing the "
                "checkpoint: no rank waited for it. A rank that exits, crashes or reads the checkpoint meanwhile finds "
                "half of it, or none (hint 3).")


def _others_waited(job):
    _judge_table((NO_BARRIER,), job)


# --- 4. the evaluation ------------------------------------------------------------------------


def _twice(counts) -> list[int]:
    return sorted(i for i, n in counts.items() if n > 1)


# Each test sample evaluated once over the ranks (readings: the job, the test samples each rank
# evaluated, and how often each was).
EVALUATION_MISTAKES = (
    Mistake("whole test set everywhere",
            lambda job, seen, counts: all(sorted(ids) == list(range(TEST_SAMPLES)) for ids in seen.values()),
            f"every rank evaluated the whole test set ({TEST_SAMPLES} samples each): the result is right, but the "
            "evaluation takes as long on 16 GPUs as on one. Give each rank its own part, and add the counts up over "
            "the ranks (hint 4)."),
    Mistake("padded test shards", lambda job, seen, counts: bool(_twice(counts)),
            lambda job, seen, counts: f"test samples {_twice(counts)[:5]} were evaluated on more than one rank "
                                      f"({sum(counts.values())} evaluations of {TEST_SAMPLES} samples): a "
                                      "DistributedSampler pads the last part with repeats, so they count twice "
                                      "(hint 4)."),
)


def _each_test_sample_once(job, runs):
    seen = {r: [i - TRAIN_SAMPLES for i in runs[r].evaluations[0]["ids"]] for r in range(WORLD)
            if runs[r].evaluations}
    if len(seen) < WORLD:
        _fail(job, "a rank never evaluated: every rank must take part in the evaluation.")
    counts = Counter(i for ids in seen.values() for i in ids)
    _judge_table(EVALUATION_MISTAKES, job, seen, counts)
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


NOT_ALL_REDUCED = Mistake(
    "metric not all-reduced",
    lambda job, reported, correct, hit: any(abs(reported - hit[r::WORLD].float().mean().item()) < 1e-6
                                            for r in range(WORLD)),
    lambda job, reported, correct, hit: f"the test accuracy {reported:.4f} is rank 0's own part only (the whole test "
                                        f"set gives {correct / TEST_SAMPLES:.4f}): the ranks' counts were never added "
                                        "up (hint 4).")


def _reported_accuracy(job, entry, weights, data_path):
    correct, ambiguous, hit = _accuracy(weights, data_path)
    reported = entry.get("test_accuracy")
    if not isinstance(reported, float):
        _fail(job, f"the metrics line {entry} has no test_accuracy.")
    # Two different fractions with denominators <= 202 differ by more than 1e-5; a float
    # division errs by about 1e-16. `ambiguous` samples may legitimately flip.
    if any(abs(reported - (correct + d) / TEST_SAMPLES) < 1e-9 for d in range(-ambiguous, ambiguous + 1)):
        return
    _judge_table((NOT_ALL_REDUCED,), job, reported, correct, hit)
    _fail(job, f"the test accuracy {reported:.6f} is not the accuracy of the trained weights over the whole "
               f"test set ({correct / TEST_SAMPLES:.6f}) (hint 4).")


# --- 5. the restart ---------------------------------------------------------------------------


def _same_order_every_epoch(runs) -> int | None:
    """The first rank that saw epoch 1 in epoch 0's order, or None."""
    return next((rank for rank in range(WORLD) if runs[rank].epoch(1) and [s["micro"] for s in runs[rank].epoch(1)]
                 == [s["micro"] for s in runs[rank].epoch(0)[:len(runs[rank].epoch(1))]]), None)


SET_EPOCH_FORGOTTEN = Mistake(
    "set_epoch forgotten", lambda job, runs: _same_order_every_epoch(runs) is not None,
    lambda job, runs: f"rank {_same_order_every_epoch(runs)} saw epoch 1 in the same order as epoch 0: the sampler "
                      "shuffles the same way every epoch unless it is told which epoch it is (hint 1).")


def _new_shuffle_every_epoch(job, runs):
    _judge_table((SET_EPOCH_FORGOTTEN,), job, runs)


def _restarted(job):
    if 1 not in job.attempts:
        _fail(job, f"the job was never restarted: the check crashes rank {CRASH_RANK} after {CRASH_AFTER} "
                   "optimizer steps, and torchrun restarts it. Did the job make that many steps?")


def _loads(job, rank, checkpoint) -> list[dict]:
    return [e for e in job.of(rank, 1, "load") if e["path"] == str(checkpoint)]


# The restart read the checkpoint, onto the rank's own device (readings: the job, the checkpoint, a rank).
LOAD_MISTAKES = (
    Mistake("no resume", lambda job, checkpoint, rank: not _loads(job, rank, checkpoint),
            lambda job, checkpoint, rank: f"after the restart, rank {rank} did not load {checkpoint.name}: the job "
                                          "started over from scratch and lost its work (hint 3)."),
    Mistake("no map_location", lambda job, checkpoint, rank: _loads(job, rank, checkpoint)[0]["map_location"] is None,
            "the checkpoint is loaded without map_location: on GPUs torch.load puts every tensor back on the GPU that "
            "saved it, so all 8 ranks of a node load onto GPU 0 (and run out of memory there). Load onto the rank's "
            "own device (hint 3)."),
)


def _loaded(job, checkpoint, before, after):
    for rank in range(WORLD):
        _judge_table(LOAD_MISTAKES, job, checkpoint, rank)


OPTIMIZER_NOT_RESTORED = Mistake(
    "optimizer not restored", lambda job, after: bool(after[0].steps) and not after[0].steps[0]["had_state"],
    "after the restart the optimizer started without its state (AdamW's moments): it was not restored from the "
    "checkpoint, so the resumed run takes other steps.")


def _optimizer_restored(job, checkpoint, before, after):
    _judge_table((OPTIMIZER_NOT_RESTORED,), job, after)


def _off_schedule(before, after) -> tuple | None:
    """(i, its learning rate, the schedule's step number) of the first step after the restart
    whose learning rate is not the schedule's, or None."""
    done = len(before[0].epoch(0))
    return next(((i, step["lr"], done + i) for i, step in enumerate(after[0].steps)
                 if not math.isclose(step["lr"], _learning_rate(done + i), rel_tol=1e-12)), None)


def _scheduler_message(job, before, after) -> str:
    i, lr, at = _off_schedule(before, after)
    over = " — the schedule started over" if math.isclose(lr, _learning_rate(i)) else ""
    return (f"step {i} after the restart used the learning rate {lr:.6g}, but step {at} of the schedule is "
            f"{_learning_rate(at):.6g}{over}: the scheduler was not restored from the checkpoint (the optimizer's "
            "saved learning rate only covers the first step).")


SCHEDULER_NOT_RESTORED = Mistake(
    "scheduler not restored", lambda job, before, after: _off_schedule(before, after) is not None, _scheduler_message)


def _scheduler_restored(job, checkpoint, before, after):
    _judge_table((SCHEDULER_NOT_RESTORED,), job, before, after)


def _reordered(before, after) -> int | None:
    """The first rank that saw epoch 1 in another order after the restart than before the crash."""
    def order(steps):
        return [s["micro"] for s in steps]

    return next((rank for rank in range(WORLD)
                 if order(after[rank].epoch(0)[:len(before[rank].epoch(1))]) != order(before[rank].epoch(1))), None)


ANOTHER_ORDER = Mistake(
    "another order after the restart", lambda job, before, after: _reordered(before, after) is not None,
    lambda job, before, after: f"after the restart rank {_reordered(before, after)} saw epoch 1 in another order than "
                               "before the crash: a resumed run must replay the same data (the sampler's seed and "
                               "epoch decide it).")


def _same_order_after_restart(job, checkpoint, before, after):
    _judge_table((ANOTHER_ORDER,), job, before, after)


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


def _logged_epochs(entries) -> list:
    return [entry.get("epoch") for entry in entries]


def _metrics_truncated(job) -> bool:
    """Whether a rank opened the metrics log for writing from its start ("w"), not appending."""
    return any(Path(str(e["path"])).name == "metrics.jsonl" and "w" in str(e["mode"]) for e in job.every("open"))


# What the metrics log holds at the end (readings: the job, its entries).
METRICS_MISTAKES = (
    Mistake("metrics lost at the restart",
            lambda job, entries: len(entries) < EPOCHS and _metrics_truncated(job),
            lambda job, entries: f"the metrics log holds epochs {_logged_epochs(entries)} of {EPOCHS}: what the first "
                                 "attempt logged before the crash is gone. A restarted job starts the script again: "
                                 "what it opens for writing must keep what is already there (hint 5)."),
    Mistake("an epoch logged twice",
            lambda job, entries: len(set(map(str, _logged_epochs(entries)))) < len(entries),
            lambda job, entries: f"the metrics log holds epochs {_logged_epochs(entries)}: an epoch's evaluation is "
                                 "logged more than once, so a plot of the run counts it twice. After a restart, the "
                                 "job goes on from the epoch after the checkpoint's (hint 5)."),
)


def _metrics_logged(job, folder, weights, data):
    epoch0, final = weights
    path = folder / "metrics.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if len(entries) != EPOCHS:
        _judge_table(METRICS_MISTAKES, job, entries)
        _fail(job, f"rank 0 logged {len(entries)} evaluations to --metrics, for {EPOCHS} epochs with a restart "
                   "in between: one line per epoch, none repeated.")
    _reported_accuracy(job, entries[0], epoch0, data)
    _reported_accuracy(job, entries[1], final, data)


def _undestroyed(job) -> list[int]:
    return [r for r in range(WORLD) if not job.of(r, max(job.attempts), "destroy")]


NO_DESTROY = Mistake(
    "no destroy_process_group", lambda job: bool(_undestroyed(job)),
    lambda job: f"ranks {_undestroyed(job)} never called destroy_process_group: a rank that leaves without it can "
                "hang or abort its exit, and its neighbours see a crash.")


def _closed(job):
    _judge_table((NO_DESTROY,), job)


# --- 7. on nodes with GPUs ----------------------------------------------------------------------

# The pretend GPU start: each node as if it had one GPU for its two processes, as a node does
# where a job asks for fewer GPUs than processes (a Run:ai GPU fraction). RANK and LOCAL_RANK
# still differ on the second node, and LOCAL_RANK alone would ask for a GPU that is not there.
PRETEND_GPUS, PRETEND_PER_NODE = 1, 2
PICKED_BY = {"set_device": "torch.cuda.set_device", "to": "the model's .to", "ddp": "DDP's device_ids"}


def pretend_gpus(script, folder, options, data):
    """Start the job on pretend GPUs: what each rank chooses is recorded, and the ranks leave
    once the model is wrapped in DDP. The ranks get the variables torchrun would give them, without
    its agents: nothing restarts here, and the main job ran under torchrun already."""
    return two_node_job.launch(script, folder, options, data=data, per_node=PRETEND_PER_NODE, agents=False,
                               probe_env={"CAPSTONE_FAKE_GPUS": str(PRETEND_GPUS)})


def _picks(events) -> list[tuple[str, str]]:
    """(how, which GPU) for each GPU the rank chose: set_device, the model's .to, DDP's device_ids."""
    picks = [(e["kind"], e["index"]) for e in events if e["kind"] in ("set_device", "to")]
    picks += [("ddp", d) for e in events if e["kind"] == "ddp" and isinstance(e["device_ids"], list)
              for d in e["device_ids"]]
    return [(kind, str(index).split(":")[-1]) for kind, index in picks if index is not None]


def _local_ranks(job) -> dict[int, int]:
    ranks = range(two_node_job.NODES * job.per_node)
    return {r: job.of(r, 0)[0]["local_rank"] if job.of(r, 0) else r % job.per_node for r in ranks}


def _backend(job, rank):
    init = job.of(rank, 0, "init")
    return init[0]["backend"] if init else None


GLOO_ON_GPUS = Mistake(
    "gloo on GPUs", lambda job, rank: _backend(job, rank) is not None and "nccl" not in _backend(job, rank),
    lambda job, rank: f"on a node with GPUs rank {rank} still starts the {_backend(job, rank)} backend: gloo moves "
                      "every gradient through the CPU; NCCL uses NVLink (hint 1).")


def _gpu_backend(job):
    for rank in _local_ranks(job):
        _judge_table((GLOO_ON_GPUS,), job, rank)


# A GPU a rank chose (readings: the job, the rank, its LOCAL_RANK, how it chose, which GPU).
GPU_FROM_RANK = Mistake(
    "a GPU from RANK", lambda job, rank, local, kind, index: index == str(rank) != str(local),
    lambda job, rank, local, kind, index: f"rank {rank} is LOCAL_RANK {local} on its node, but {PICKED_BY[kind]} got "
                                          f"GPU {index}: RANK counts over all nodes (8-15 on the second DGX node), a "
                                          "node's GPUs are numbered by LOCAL_RANK (hint 1).")
A_GPU_THE_NODE_DOES_NOT_HAVE = Mistake(
    "a GPU the node does not have",
    lambda job, rank, local, kind, index: index.isdigit() and int(index) >= PRETEND_GPUS,
    lambda job, rank, local, kind, index: f"rank {rank} (LOCAL_RANK {local}) runs on a node with {PRETEND_GPUS} GPU "
                                          f"for {job.per_node} processes, as under a Run:ai GPU fraction, and "
                                          f"{PICKED_BY[kind]} asked for GPU {index}, which that node does not have: "
                                          "with fewer GPUs than processes, the processes share them (hint 1).")


def _gpu_picked(job):
    """Which GPU each choice named: LOCAL_RANK's, shared where the node has fewer GPUs."""
    local = _local_ranks(job)
    for rank in local:  # RANK first: it is the likelier cause of a GPU that is not there
        for kind, index in _picks(job.of(rank, 0)):
            _judge_table((GPU_FROM_RANK,), job, rank, local[rank], kind, index)
    for rank in local:
        for kind, index in _picks(job.of(rank, 0)):
            _judge_table((A_GPU_THE_NODE_DOES_NOT_HAVE,), job, rank, local[rank], kind, index)
            if index != str(local[rank] % PRETEND_GPUS):
                _fail(job, f"rank {rank} is LOCAL_RANK {local[rank]} on a node of {PRETEND_GPUS} GPU, but "
                           f"{PICKED_BY[kind]} got GPU {index}: a node's GPUs are numbered by LOCAL_RANK (hint 1).")


NO_SET_DEVICE = Mistake(
    "no set_device", lambda job, rank: not job.of(rank, 0, "set_device"),
    lambda job, rank: f"rank {rank} never called torch.cuda.set_device: whatever is made on 'cuda' without an index "
                      "(NCCL's own buffers too) lands on GPU 0, so 8 ranks share it (hint 1).")


def _device_ids(job, rank):
    ddp = job.of(rank, 0, "ddp")
    return ddp[0]["device_ids"] if ddp else None


DEVICE_IDS_NOT_A_LIST = Mistake(
    "device_ids not a list",
    lambda job, rank: _device_ids(job, rank) is not None and not isinstance(_device_ids(job, rank), list),
    lambda job, rank: f"device_ids={_device_ids(job, rank)} is not a list: DDP wants the list of the one GPU this "
                      "process uses (hint 1).")


def _gpu_set_device(job):
    for rank in _local_ranks(job):
        _judge_table((NO_SET_DEVICE,), job, rank)


def _gpu_device_ids(job):
    for rank in _local_ranks(job):
        _judge_table((DEVICE_IDS_NOT_A_LIST,), job, rank)


def _gpu_job_wrapped(job):
    if job.failed or not job.every("ddp"):
        _fail(job, "on a node with a GPU, your job failed before it wrapped the model in DDP. The first "
                   f"error of a rank:\n{_first_traceback(job)[-2500:]}")


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
            self.failures.append(failure if isinstance(failure, CheckFailed) else
                                 CheckFailed(f"{step.__name__} could not judge: {failure!r}"))
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
        job = two_node_job.launch(script, folder, options, data=data, max_restarts=1,
                                  watch=None if judge.collect and not first_attempt_only else watch,
                                  probe_env={"CAPSTONE_CRASH": f"{CRASH_RANK}:{CRASH_AFTER}",
                                             "CAPSTONE_SAVE_DELAY": str(SAVE_DELAY)})
    except _FirstAttemptJudged:
        return
    except _FailedByItself as stopped:
        job = stopped.job
    _joined(job)
    if job.timed_out or job.failed:
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


def capstone_job_mistakes(script, folder, first_attempt_only=False) -> list[CheckFailed]:
    """What the check says of every step that fails for ``script``, not only the first (in the
    check's order), each failure naming its mistake: the tests plant several mistakes in one
    script and launch it once. With
    ``first_attempt_only`` the job stops once its first attempt is judged, as it does for a
    learner whose first attempt shows a mistake."""
    judge = _Judge(collect=True)
    _judged(script, folder, judge, first_attempt_only)
    return judge.failures


class _Line:
    """A `runai ... submit` line, read: its words, the pods' command, and the job it should start
    (``nodes`` DGX nodes of ``gpus_per_node`` GPUs running ``script``)."""

    def __init__(self, line: str, script: str, nodes: int, gpus_per_node: int):
        self.words, self.script, self.nodes, self.gpus = shlex.split(line), script, nodes, gpus_per_node
        self.command = " ".join(self.words[self.words.index("--") + 1:]) if "--" in self.words else ""
        self.master = "--no-master" not in self.words  # Run:ai adds a master pod, which trains too, unless told not to

    def value(self, flag):
        return self.words[self.words.index(flag) + 1] if flag in self.words else None

    @property
    def pods(self) -> int:
        return int(self.value("--workers") or 0) + self.master

    @property
    def per_node(self) -> list[str]:
        return [w for w in shlex.split(self.command) if w.startswith("--nproc-per-node")]

    @property
    def image(self) -> str:
        return self.value("-i") or ""

    @property
    def environment(self) -> list[str]:
        return [self.words[i + 1] for i, word in enumerate(self.words[:-1]) if word == "-e"]


def _no_registry(image: str) -> bool:
    host = image.split("/")[0]
    return "/" not in image or "." not in host and ":" not in host


# The line runs the script on the nodes with all their GPUs: its pods and GPUs, each pod's
# command, the image, resources and environment (readings: the line), in this order.
SUBMIT_MISTAKES = (
    Mistake("not a distributed workload", lambda x: x.words[1:4] != ["training", "pytorch", "submit"],
            "this is not a distributed PyTorch workload: `runai training submit` makes ONE pod. Pass workers=... to "
            "submit_command for `runai training pytorch submit`, so the training operator starts the pods and their "
            "rendezvous."),
    Mistake("pods not the nodes", lambda x: x.pods != x.nodes,
            lambda x: f"this line asks for {x.pods} pods ({x.value('--workers')} workers"
                      + (" and the master pod Run:ai adds" if x.master else ", no master") +
                      f"), each a whole DGX node, but the job should use {x.nodes} nodes: count every pod that "
                      "trains."),
    Mistake("not all the node's GPUs", lambda x: x.value("--gpu-devices-request") != str(x.gpus),
            lambda x: f"--gpu-devices-request is {x.value('--gpu-devices-request')}: a pod is one node here, so ask "
                      f"for all its {x.gpus} GPUs (gpus={x.gpus})."),
    Mistake("no torchrun", lambda x: "torchrun" not in x.command and "torch.distributed.run" not in x.command,
            "the pod's command does not start torchrun: plain python starts one process, but the script reads "
            "RANK/LOCAL_RANK that torchrun sets, one per GPU."),
    Mistake("standalone", lambda x: "--standalone" in x.command,
            "--standalone makes every pod a job of its own (a private rendezvous on localhost): leave it out, "
            "torchrun reads the shared rendezvous from the PET_* variables the operator injects."),
    Mistake("not one process per GPU",
            lambda x: not x.per_node or x.per_node[0].split("=")[-1] not in (str(x.gpus), "gpu"),
            lambda x: f"torchrun should start one process per GPU, --nproc-per-node={x.gpus} (or gpu), got "
                      f"{x.per_node or 'none'}."),
    Mistake("another script", lambda x: x.script not in x.command, lambda x: f"the command does not run {x.script}."),
    Mistake("no registry", lambda x: _no_registry(x.image),
            lambda x: f"the image {x.image!r} names no registry: Run:ai would pull it from Docker Hub, where the "
                      "team's image is not. Give it whole: registry host, project, image."),
    Mistake("memory without a unit",
            lambda x: x.value("--cpu-memory-request") is None or not x.value("--cpu-memory-request")[-1].isalpha(),
            lambda x: f"the memory request is {x.value('--cpu-memory-request')!r}: a Kubernetes quantity without a "
                      "unit counts bytes. Ask with a unit (G, Gi)."),
    Mistake("a shared rendezvous store", lambda x: "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in x.environment,
            "the pods' environment does not give a restarted round its own rendezvous store (chapter 07): by "
            "default the restarted workers share the previous round's store, can read the dead workers' "
            "addresses, and fail instead of resuming."),
)
# ...and after the rehearsal, where the files live.
NO_VOLUME = Mistake(
    "no team volume", lambda x: x.value("--existing-pvc") is None or "/data" not in x.command,
    "mount the team's volume (pvc=...) and keep the script and --checkpoint on it (cd /data/...): a pod's own disk "
    "disappears with the pod, and with it the checkpoint a restarted job needs.")


def check_capstone_submit(line: str, script: str = "train.py", nodes: int = 2,
                          gpus_per_node: int = 8) -> None:
    """The Run:ai line runs ``script`` on ``nodes`` DGX nodes with all their GPUs, from the
    cluster's facts: its pods and GPUs, each pod's command, the image, resources and environment;
    then each pod's command rehearsed as the cluster runs it."""
    if not isinstance(line, str) or not line.startswith("runai "):
        raise CheckFailed(f"expected the runai command line as a string, got {line!r}: build it with "
                          "spike_course.runai.submit_command(...).")
    x = _Line(line, script, nodes, gpus_per_node)
    name_the_first(SUBMIT_MISTAKES, x)
    _rehearsed(line)
    name_the_first((NO_VOLUME,), x)
    passed(f"`runai training pytorch submit` with {nodes} pods of {gpus_per_node} GPUs, each "
           f"running torchrun on {script}; rehearsed under both operator releases, the pods meet "
           "and a SIGTERM reaches torchrun")


def _rehearsed(line):
    """Each pod's command, read as the cluster runs it (chapter 07, section 7.6), under both
    operator releases: the first mistake the rehearsal names is the learner's (the rehearsal's
    own table names it)."""
    from .. import rehearsal
    from ..rehearsal.findings import LINE, seen

    for flavour in ("older", "newer"):
        mistakes = seen(LINE, rehearsal.read(line, flavour))
        if mistakes:
            name, message = mistakes[0]
            raise CheckFailed(f"rehearsed as the cluster would run it (an {flavour} training operator): "
                              f"{message} [{name}]", mistake=name)
