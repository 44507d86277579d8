"""Does the course CNN really learn the synthetic digits? One short epoch, then test.

    python benchmarks/synthetic_accuracy.py [--train 4000] [--test 2000]

The foundation issue asks for at least 95% test accuracy after one short epoch on a
few thousand images. Prints the accuracy and the time each part took.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

os.environ["SPIKE_COURSE_DATA"] = "synthetic"
from spike_course.data import load_mnist  # noqa: E402
from spike_course.models import Net  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)

    started = time.perf_counter()
    train, test = load_mnist(train=True, limit=args.train), load_mnist(train=False, limit=args.test)
    made = time.perf_counter()

    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    model.train()
    for images, labels in torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True):
        optimizer.zero_grad()
        F.nll_loss(model(images), labels).backward()
        optimizer.step()
    trained = time.perf_counter()

    model.eval()
    correct = 0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(test, batch_size=500):
            correct += (model(images).argmax(1) == labels).sum().item()
    accuracy = correct / len(test)
    print(f"data: {len(train)} train + {len(test)} test images rendered in {made - started:.1f} s")
    print(f"one epoch (batch {args.batch_size}, Adadelta lr {args.lr}): {trained - made:.1f} s")
    print(f"test accuracy: {accuracy:.2%} ({correct}/{len(test)})")


if __name__ == "__main__":
    main()
