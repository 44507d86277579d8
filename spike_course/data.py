"""MNIST for the course, with a synthetic stand-in when MNIST cannot be had.

``load_mnist(root, train, limit)`` returns a Dataset of ``(1x28x28 float tensor, int label)``
normalised like PyTorch's MNIST example. It uses torchvision's MNIST when the files are
under ``root`` or can be downloaded within a few seconds. Otherwise (an offline laptop,
a cluster node without internet, CI) it says so in one line (once per notebook kernel, its
launched ranks included; once per job under torchrun) and returns synthetic
digits of the same shape: handwriting-like strokes of several styles plus a printed
font, each randomly scaled, rotated, sheared, moved and thickened, with noise. The
set is deterministic (sample i is always the same image, whatever ``limit`` is), and
the course CNN learns it for real, which makes the training chapters meaningful.

``SPIKE_COURSE_DATA=synthetic`` forces the synthetic set; ``SPIKE_COURSE_DATA=mnist``
refuses to fall back.
"""

from __future__ import annotations

import io
import math
import os
import socket
from urllib.parse import urlparse

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch.utils.data import Dataset, Subset

from .protocol import DATA_FALLBACK_SAID_ENV, write_atomically

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_SIZES = {True: 60_000, False: 10_000}  # the sizes of MNIST's train and test sets
DOWNLOAD_SECONDS = 5.0
CACHE_FROM = 10_000  # render smaller sets on the fly (about 0.5 ms an image); cache bigger ones


def _arc(cx, cy, rx, ry, start, stop, n=14):
    """Points along an ellipse, angles in degrees, 0 pointing right and 90 pointing down."""
    angles = np.radians(np.linspace(start, stop, n))
    return [(cx + rx * math.cos(a), cy + ry * math.sin(a)) for a in angles]


# Each digit: a list of styles; each style: a list of strokes (polylines) in a unit box.
STROKES = {
    0: [[_arc(0.5, 0.5, 0.28, 0.42, 0, 360, 24)],
        [_arc(0.5, 0.5, 0.22, 0.4, -80, 290, 24)]],
    1: [[[(0.5, 0.08), (0.5, 0.92)]],
        [[(0.32, 0.26), (0.56, 0.08), (0.56, 0.92)], [(0.36, 0.92), (0.76, 0.92)]]],
    2: [[_arc(0.5, 0.32, 0.27, 0.24, 180, 380) + [(0.2, 0.92), (0.82, 0.92)]],
        [_arc(0.48, 0.3, 0.26, 0.22, 200, 400) + [(0.22, 0.9), (0.45, 0.82), (0.82, 0.9)]]],
    3: [[_arc(0.48, 0.29, 0.25, 0.21, 200, 450), _arc(0.48, 0.7, 0.29, 0.22, 270, 520)]],
    4: [[[(0.66, 0.92), (0.66, 0.08), (0.14, 0.64), (0.86, 0.64)]],
        [[(0.28, 0.08), (0.22, 0.58), (0.84, 0.58)], [(0.66, 0.28), (0.64, 0.92)]]],
    5: [[[(0.76, 0.08), (0.32, 0.08), (0.28, 0.44)] + _arc(0.5, 0.66, 0.28, 0.26, 220, 520)]],
    6: [[[(0.7, 0.08), (0.45, 0.22), (0.29, 0.45), (0.25, 0.66)], _arc(0.5, 0.68, 0.25, 0.24, 0, 360)]],
    7: [[[(0.18, 0.08), (0.82, 0.08), (0.42, 0.92)]],
        [[(0.18, 0.1), (0.82, 0.1), (0.46, 0.92)], [(0.36, 0.5), (0.72, 0.5)]]],
    8: [[_arc(0.5, 0.29, 0.22, 0.2, 0, 360), _arc(0.5, 0.7, 0.27, 0.22, 0, 360)]],
    9: [[_arc(0.5, 0.32, 0.25, 0.23, 0, 360), [(0.75, 0.32), (0.72, 0.92)]],
        [_arc(0.48, 0.31, 0.24, 0.22, 0, 360), [(0.72, 0.34), (0.66, 0.72), (0.44, 0.92)]]],
}

_RENDER = 56  # draw at twice the size, then shrink: cheap anti-aliasing


def _font(size):
    try:
        return ImageFont.load_default(size=size)  # a scalable font shipped inside Pillow
    except (TypeError, OSError):
        return None


def render_digit(label: int, rng: np.random.Generator) -> np.ndarray:
    """One 28x28 uint8 image of ``label``, white on black like MNIST."""
    image = Image.new("L", (_RENDER, _RENDER), 0)
    draw = ImageDraw.Draw(image)
    angle = math.radians(rng.uniform(-15, 15))
    scale = rng.uniform(0.62, 0.86) * _RENDER
    shear = rng.uniform(-0.3, 0.3)
    shift = rng.uniform(-0.07, 0.07, size=2) * _RENDER
    font = _font(int(scale * 1.05)) if rng.random() < 0.2 else None
    if font is not None:
        # A printed digit, rotated afterwards.
        draw.text((_RENDER / 2 + shift[0], _RENDER / 2 + shift[1]), str(label), fill=255,
                  font=font, anchor="mm")
        image = image.rotate(math.degrees(angle), resample=Image.BILINEAR)
    else:
        styles = STROKES[label]
        strokes = styles[rng.integers(len(styles))]
        width = int(rng.integers(4, 8))
        cos, sin = math.cos(angle), math.sin(angle)
        for stroke in strokes:
            points = np.asarray(stroke) - 0.5 + rng.normal(0, 0.018, size=(len(stroke), 2))
            x = points[:, 0] + shear * points[:, 1]
            y = points[:, 1]
            px = (cos * x - sin * y) * scale + _RENDER / 2 + shift[0]
            py = (sin * x + cos * y) * scale + _RENDER / 2 + shift[1]
            draw.line(list(zip(px.tolist(), py.tolist())), fill=255, width=width, joint="curve")
    small = np.asarray(image.resize((28, 28), Image.BILINEAR), dtype=np.float32)
    small = small * rng.uniform(0.75, 1.0) + rng.normal(0, 12, size=small.shape)
    return np.clip(small, 0, 255).astype(np.uint8)


class SyntheticDigits(Dataset):
    """A deterministic MNIST look-alike. ``.data`` (N x 28 x 28 uint8) and ``.targets``
    mirror torchvision's MNIST; items are normalised 1x28x28 float tensors and int labels."""

    def __init__(self, train: bool = True, size: int | None = None, seed: int = 2024,
                 cache_dir: str | None = None):
        size = SYNTHETIC_SIZES[train] if size is None else size
        split = 0 if train else 1
        cache = os.path.join(cache_dir, f"synthetic_{seed}_{split}_{size}.pt") if cache_dir else None
        if cache and os.path.exists(cache):
            self.data, self.targets = torch.load(cache, weights_only=True)
        else:
            self.data, self.targets = self._render(size, seed, split)
            if cache and size >= CACHE_FROM:
                os.makedirs(cache_dir, exist_ok=True)
                buffer = io.BytesIO()
                torch.save((self.data, self.targets), buffer)
                write_atomically(cache, buffer.getvalue())  # ranks rendering at once never read half a file
        self._normalised = ((self.data.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)

    @staticmethod
    def _render(size, seed, split):
        images, labels = [], []
        for i in range(size):
            rng = np.random.default_rng([seed, split, i])  # sample i never depends on size
            label = int(rng.integers(10))
            images.append(render_digit(label, rng))
            labels.append(label)
        data = torch.from_numpy(np.stack(images)) if images else torch.empty(0, 28, 28, dtype=torch.uint8)
        return data, torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        return self._normalised[index], int(self.targets[index])


def mnist_transform():
    from torchvision import transforms

    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])


def _say_once(message: str) -> None:
    """Print ``message`` on rank 0 (one line per job, not one per rank), unless this process,
    or the kernel that launched it, already did."""
    if os.environ.get(DATA_FALLBACK_SAID_ENV):
        return
    os.environ[DATA_FALLBACK_SAID_ENV] = "1"
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)


def _mirror_reachable(seconds: float) -> bool:
    from torchvision.datasets import MNIST

    for mirror in MNIST.mirrors:
        host = urlparse(mirror).hostname
        try:
            socket.create_connection((host, 443), timeout=seconds).close()
            return True
        except OSError:
            continue
    return False


def _torchvision_mnist(root, train, download):
    from torchvision.datasets import MNIST

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_SECONDS)  # a stalled download must not hang a notebook
    try:
        return MNIST(root, train=train, download=download, transform=mnist_transform())
    finally:
        socket.setdefaulttimeout(old)


# Where MNIST's files go, in torchvision's layout, for every chapter at once.
WHERE_MNIST_GOES = ("data/MNIST/raw/ in the course folder (train-images-idx3-ubyte and the other "
                    "three files, gzipped or not)")


def data_source(root: str = "data") -> str:
    """Which source ``load_mnist`` would use, without downloading anything."""
    choice = os.environ.get("SPIKE_COURSE_DATA", "auto")
    if choice == "synthetic":
        return "synthetic digits (SPIKE_COURSE_DATA=synthetic)"
    found = mnist_root(root)
    if _has_files(found):
        return f"MNIST files under {os.path.abspath(found)}/"
    return f"MNIST download if reachable within seconds, else synthetic digits; MNIST goes in {WHERE_MNIST_GOES}"


def mnist_root(root: str = "data") -> str:
    """``root`` if MNIST is there; else the first ``data`` folder above the working directory
    that holds it (one copy in the course folder serves notebooks/, solutions/, exercises/
    and their workers); else ``root``, where a download would go."""
    if _has_files(root) or os.path.isabs(root) or root != "data":
        return root
    here = os.path.abspath(os.getcwd())
    while True:
        here, child = os.path.dirname(here), here
        if here == child:
            return root
        if _has_files(os.path.join(here, "data")):
            return os.path.join(here, "data")


def _has_files(root) -> bool:
    raw = os.path.join(root, "MNIST", "raw")
    return os.path.isdir(raw) and any(name.startswith("train-images") for name in os.listdir(raw))


def load_mnist(root: str = "data", train: bool = True, limit: int | None = None) -> Dataset:
    """MNIST (or the synthetic stand-in): the first ``limit`` samples, or all of them."""
    choice = os.environ.get("SPIKE_COURSE_DATA", "auto")
    if choice not in ("auto", "mnist", "synthetic"):
        raise ValueError(f"SPIKE_COURSE_DATA={choice!r}: use 'synthetic', 'mnist' or leave it unset")
    dataset = None
    if choice != "synthetic":
        root = mnist_root(root)
        try:
            dataset = _torchvision_mnist(root, train, download=False)
        except RuntimeError:  # not on disk
            try:
                if _mirror_reachable(DOWNLOAD_SECONDS / 2):
                    dataset = _torchvision_mnist(root, train, download=True)
            except (OSError, RuntimeError) as error:
                reason = error
            else:
                reason = "no MNIST mirror reachable"
            if dataset is None:
                if choice == "mnist":
                    raise RuntimeError(f"MNIST is not under {root}/ and could not be downloaded ({reason}); "
                                       "unset SPIKE_COURSE_DATA to fall back to synthetic digits") from None
                _say_once(f"MNIST not found under {root}/ and not downloadable ({reason}): "
                     f"using synthetic digits of the same shape. To use MNIST, put it in {WHERE_MNIST_GOES}.")
    if dataset is None:
        return SyntheticDigits(train=train, size=limit, cache_dir=os.path.join(root, "synthetic"))
    if limit is not None:
        dataset = Subset(dataset, range(min(limit, len(dataset))))
    return dataset
