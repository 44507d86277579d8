"""The models used throughout the course.

``Net`` is the classic MNIST CNN (the one of PyTorch's MNIST example): two convolutions,
dropout, two fully connected layers and a log-softmax. Chapters that need another model
(a tiny transformer for tensor parallel and FSDP) add it here.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F


def Net(dropout: bool = True) -> nn.Sequential:
    """conv 32 -> conv 64 -> max-pool -> dropout -> fc 128 -> dropout -> fc 10 -> log-softmax.

    A named ``nn.Sequential``: every step, the functional ones too, is a child module, so
    ``net.conv1`` works as usual, a pipeline stage or a feature extractor is a slice
    (``net[:layer_index(net, "fc2")]``: everything before the classifier) that shares the
    parameters, and the parameters keep their names ("conv1.weight", ...). A function
    rather than a subclass, because slicing a ``Sequential`` subclass would call the
    subclass's constructor.
    ``dropout=False`` turns both dropouts into no-ops; chapters that compare a parallel
    run with a single-process run use it, because dropout masks differ between the two.
    """
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, 32, 3, 1), relu1=nn.ReLU(),
        conv2=nn.Conv2d(32, 64, 3, 1), relu2=nn.ReLU(),
        pool=nn.MaxPool2d(2), dropout1=nn.Dropout(0.25 if dropout else 0.0), flatten=nn.Flatten(),
        fc1=nn.Linear(9216, 128), relu3=nn.ReLU(),  # 9216 = 64 channels x 12 x 12 after the pool
        dropout2=nn.Dropout(0.5 if dropout else 0.0),
        fc2=nn.Linear(128, 10), log_softmax=nn.LogSoftmax(dim=1)))


def layer_index(net: nn.Sequential, name: str) -> int:
    """Position of the child called ``name`` in a named ``nn.Sequential``: ``net[:i]`` ends
    just before it."""
    return list(dict(net.named_children())).index(name)


# --- a tiny Llama-style transformer (tensor parallel and FSDP chapters) ---


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention with the Llama names wq, wk, wv, wo.

    The number of heads is read from the projection's output size (``-1`` in ``view``),
    so the same code runs when tensor parallel leaves each rank only some of the heads.
    """

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ClippedBlock(nn.Module):
    """A residual MLP block as a research script writes it for eager PyTorch: an update whose
    largest magnitude exceeds ``limit`` is scaled down to it, and the update is scaled by
    ``depth`` (the block's place in the stack). Chapter 16.5's exercise makes it compile as one
    graph that every block shares, with the same bits."""

    def __init__(self, dim: int, depth: int, limit: float = 1.0):
        super().__init__()
        self.depth, self.limit = depth, limit
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.down(torch.relu(self.up(x)))
        peak = update.abs().amax()
        if peak > self.limit:
            update = update * (self.limit / peak)
        return x + update * (self.depth + 1) ** -0.5


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyTransformer(nn.Module):
    """A decoder-only language model small enough to train on a laptop CPU.

    Module names follow Llama (tok_embeddings, layers.i.attention.wq, ...,
    layers.i.feed_forward.w1, norm, output), the names tensor-parallel plans refer to.
    ``forward(tokens)`` takes (batch, seq) token ids and returns (batch, seq, vocab) logits.
    """

    def __init__(self, vocab_size: int = 64, dim: int = 32, n_layers: int = 2,
                 n_heads: int = 4, hidden: int = 64, max_seq_len: int = 32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# --- chapter 04: pipeline parallel (Net split into stages) ---


def split_net(net: nn.Sequential) -> tuple[nn.Sequential, nn.Sequential]:
    """Cut ``Net`` into two pipeline stages, the convolutions and the classifier, just
    before ``fc1``: stage 0 maps images (N,1,28,28) to features (N,9216), stage 1 maps
    those to log-probabilities (N,10). Slices share ``net``'s modules and names, so
    ``stage1(stage0(x))`` equals ``net(x)`` and the parameters compare by name."""
    cut = layer_index(net, "fc1")
    return net[:cut], net[cut:]
