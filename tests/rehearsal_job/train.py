"""torchrun --nproc-per-node=1 train.py --ckpt ck.pt [--steps N] [--save-seconds S] [--slip NAME ...]

A job for the rehearsal's tests: it steps until SIGTERM (or N steps), saves rank 0's checkpoint (after
--save-seconds), then exits. Each --slip plants one mistake a rehearsal must name."""
import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--save-seconds", type=float, default=0.0)
parser.add_argument("--slip", action="append", default=[])
parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: at SIGTERM)")
args = parser.parse_args()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
dist.init_process_group("gloo")
rank = dist.get_rank()
weights = torch.zeros(4)
if rank == 0:   # the first checkpoint, before any SIGTERM
    torch.save({"weights": weights, "step": 0}, args.ckpt)
dist.barrier()
if "same-file" in args.slip:
    torch.save(weights, os.path.join(os.path.dirname(args.ckpt), "shared.pt"))
if "outside" in args.slip:
    with open(os.path.expanduser("~/metrics.json"), "w") as out:
        json.dump({"rank": rank}, out)
if "half-written" in args.slip and rank == 0:
    with open(args.ckpt, "wb") as out:   # a save that never ends, into the checkpoint's own name
        out.write(b"PK\x03\x04 not a whole checkpoint")
        out.flush()
        while True:
            time.sleep(0.1)
step = 0
while True:
    step += 1
    flag = torch.tensor([float(len(stop))])
    dist.all_reduce(flag)
    if flag.item() or step == args.steps:
        break
    time.sleep(0.1)
if rank == 0:
    time.sleep(args.save_seconds)
    torch.save({"weights": weights, "step": step}, args.ckpt + ".tmp")
    os.replace(args.ckpt + ".tmp", args.ckpt)
dist.barrier()
dist.destroy_process_group()
