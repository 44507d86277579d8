"""Closed-form memory costs: ZeRO/FSDP bytes per device (chapter 06, ZeRO paper); activations
of the tiny transformer, exactly as autograd saves them, and a planner (chapter 11)."""

from __future__ import annotations


ZERO_STAGES = (0, 1, 2, 3)


def zero_memory_breakdown(num_params: float, dp_size: int, stage: int, k: float = 12, *,
                          param_bytes: float = 2, grad_bytes: float = 2) -> dict:
    """Bytes per device of parameters, gradients and optimizer state under ZeRO ``stage``.

    Rajbhandari et al. (2019), section 3 and figure 1: with mixed-precision Adam a model
    of Psi parameters holds 2 Psi bytes of fp16/bf16 parameters, 2 Psi of gradients and
    K Psi of optimizer state (K = 12: fp32 master weights, momentum and variance).
    Stage 1 shards the optimizer state over the ``dp_size`` = N_d data-parallel ranks,
    stage 2 also the gradients, stage 3 also the parameters; stage 0 is plain data
    parallel. ``param_bytes``/``grad_bytes``/``k`` let the same formulas describe other
    precisions, e.g. fp32 Adam without a master copy: 4, 4 and k=8.
    Activations and temporary buffers are not counted (the paper's "residual states").
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size!r}")
    n = dp_size
    return {
        "parameters": param_bytes * num_params / (n if stage >= 3 else 1),
        "gradients": grad_bytes * num_params / (n if stage >= 2 else 1),
        "optimizer": k * num_params / (n if stage >= 1 else 1),
    }


def zero_memory(num_params: float, dp_size: int, stage: int, k: float = 12, *,
                param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per device for model states under ZeRO ``stage`` (0-3), the paper's formulas:

    stage 0: (2 + 2 + K) Psi            stage 1: 4 Psi + K Psi / N_d
    stage 2: 2 Psi + (2 + K) Psi / N_d  stage 3: (2 + 2 + K) Psi / N_d

    e.g. Psi = 7.5e9, N_d = 64, K = 12 gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.
    """
    return sum(zero_memory_breakdown(num_params, dp_size, stage, k,
                                     param_bytes=param_bytes, grad_bytes=grad_bytes).values())


# --- chapter 11: making a model fit (activations, the tools, a planner) ---

PRECISIONS = ("fp32", "autocast", "bf16")  # plain fp32; bf16 autocast; FSDP2 MixedPrecisionPolicy


def transformer_params(layers: int, dim: int, hidden: int, vocab: int, max_seq_len: int = 0) -> int:
    """Parameters of ``models.TinyTransformer`` (a Llama-style decoder; ``max_seq_len`` = 0
    for Llama itself, which has no learned positions): per block 4 dim^2 (attention),
    3 dim hidden (SwiGLU) and 2 dim (two RMSNorms); token and position embeddings, the
    final norm and the output projection."""
    return layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim) + 2 * vocab * dim + max_seq_len * dim + dim


def activation_bytes(batch: int, seq: int, dim: int, hidden: int, layers: int, heads: int, vocab: int,
                     precision: str = "fp32", checkpoint: bool = False) -> int:
    """Bytes autograd saves for backward in one forward of ``TinyTransformer`` plus its
    cross-entropy loss, parameters not counted: the number ``saved_tensors_hooks`` measures
    in chapter 11, exactly (one count per distinct storage). T = batch * seq tokens.

    Per block in fp32, in elements: each RMSNorm keeps its input, 1/rms and x/rms and its
    output (3 T dim + T, twice); attention keeps q, k, v and its output (4 T dim) and
    the log-sum-exp of each head's row (T heads, always fp32); the SwiGLU MLP keeps
    w1 x, w3 x, silu(w1 x) and their product (4 T hidden). After the blocks: the final
    norm (3 T dim + T), the log-softmax of the logits (T vocab), and integers: token ids
    and targets (8 bytes each), positions (8 seq) and the loss's weight total (a scalar).

    ``checkpoint``: every block is checkpointed and keeps only its input (T dim).
    ``precision``: "fp32"; "bf16" (FSDP2's MixedPrecisionPolicy: everything computed in
    bf16, 2 bytes, but the log-sum-exp); "autocast" (bf16 autocast around fp32 weights:
    the norms stay fp32, every linear saves a bf16 copy of its input, made once per linear
    (3 of the same normed input for wq, wk, wv, 2 for w1, w3), and of its weight (the
    weight cast is cached for the forward), the logits' log-softmax runs in fp32).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    t = batch * seq
    ints = 8 * (2 * t + seq)
    lse = 4 * t * heads
    if precision == "autocast":
        block = 4 * (4 * t * dim + 2 * t) + 2 * (5 * t * dim + 4 * t * dim + 4 * t * hidden) + lse \
            + 2 * (4 * dim * dim + 3 * dim * hidden)
        final = 4 * (2 * t * dim + t) + 2 * (t * dim + dim * vocab) + 4 * t * vocab + 4
    else:
        a = 4 if precision == "fp32" else 2
        block = a * (10 * t * dim + 2 * t + 4 * t * hidden) + lse
        final = a * (3 * t * dim + t + t * vocab) + a
    if checkpoint:
        block = (4 if precision != "bf16" else 2) * t * dim
    return layers * block + final + ints


# Models the planner knows: (layers, dim, hidden, heads, vocab, max_seq_len). Llama 3 uses
# grouped-query attention (8 key/value heads), which saves less than the full multi-head
# attention counted here: for those models the activations are a slight overestimate.
MODEL_SHAPES = {
    "tiny (chapter 11)": (2, 32, 64, 4, 64, 32),
    "Llama 3.2 1B": (16, 2048, 8192, 32, 128256, 0),
    "Llama 3 8B": (32, 4096, 14336, 32, 128256, 0),
    "Llama 3 70B": (80, 8192, 28672, 64, 128256, 0),
}
B200_MEMORY = 180e9  # bytes of HBM per GPU in a DGX B200 (1440 GB for 8)
USABLE = 0.9         # of a GPU's memory for tensors: the CUDA context, the allocator's
                     # fragmentation and each op's temporaries need the rest


def memory_plan(shape, seq: int, micro_batch: int, dp: int = 1, tp: int = 1, pp: int = 1,
                shard: int = 1, precision: str = "fp32", checkpoint: bool = False,
                offload: bool = False, gpu_memory: float = B200_MEMORY) -> dict:
    """Bytes per rank, by kind, of one training step with Adam, and whether they fit.

    ``shape`` = (layers, dim, hidden, heads, vocab, max_seq_len) or a name of
    ``MODEL_SHAPES``; the mesh has dp x tp x pp ranks, and FSDP shards over groups of
    ``shard`` (F) of the dp ranks (F = 1: DDP; F = dp: ZeRO-3). Model states are the ZeRO-3
    formula with N_d = F on the parameters a rank's tensor-parallel and pipeline slice
    owns: 16 bytes per parameter in every precision (fp32: 4 + 4 + 8 of Adam; mixed
    precision: fp32 master weights, fp32 gradients, Adam). ``offload`` keeps them in host
    memory (FSDP2's CPUOffloadPolicy). Activations are :func:`activation_bytes` of one
    micro-batch, divided by tp (assuming sequence parallelism for what tp does not split)
    and, with pp stages under 1F1B, the first stage holds pp micro-batches of its
    layers/pp layers: as many layers as the whole model, of one micro-batch. Not
    counted: the FSDP unit gathered for compute and temporaries (``USABLE`` leaves room).
    """
    if isinstance(shape, str):
        shape = MODEL_SHAPES[shape]
    layers, dim, hidden, heads, vocab, max_seq = shape
    if dp % shard:
        raise ValueError(f"the sharding factor F={shard} must divide dp={dp}")
    if layers % pp:
        raise ValueError(f"pp={pp} stages must divide the {layers} layers")
    psi = transformer_params(layers, dim, hidden, vocab, max_seq) / (tp * pp)
    states = zero_memory_breakdown(psi, shard, 3, k=8, param_bytes=4, grad_bytes=4)
    acts = activation_bytes(micro_batch, seq, dim, hidden, layers, heads, vocab, precision, checkpoint) / tp
    plan = {kind: 0.0 if offload else value for kind, value in states.items()}
    plan["activations"] = acts
    plan["host"] = sum(states.values()) if offload else 0.0
    plan["total"] = sum(plan[k] for k in ("parameters", "gradients", "optimizer", "activations"))
    plan["budget"] = USABLE * gpu_memory
    plan["fits"] = plan["total"] <= plan["budget"]
    return plan


def fit_suggestions(shape, seq: int, micro_batch: int, dp: int = 1, tp: int = 1, pp: int = 1,
                    shard: int = 1, precision: str = "fp32", checkpoint: bool = False,
                    offload: bool = False, gpu_memory: float = B200_MEMORY) -> list[str]:
    """Settings that would make :func:`memory_plan` fit, each as a short phrase, in the
    order to try them: the ones that cost least first. Each adds to the ones before
    (checkpointing, then bf16, then sharding over all dp ranks, then smaller micro-batches
    with gradient accumulation to keep the batch, then CPU offload). Empty when it
    already fits; the last entry says so when nothing on the list is enough."""
    settings = dict(dp=dp, tp=tp, pp=pp, shard=shard, precision=precision, checkpoint=checkpoint,
                    offload=offload, gpu_memory=gpu_memory)
    if memory_plan(shape, seq, micro_batch, **settings)["fits"]:
        return []
    steps = [("checkpoint", True, "activation checkpointing per block"),
             ("precision", "bf16", "bf16 compute with fp32 master weights (MixedPrecisionPolicy)"),
             ("shard", dp, f"shard over all dp ranks (F = {dp})")]
    suggestions, batch = [], micro_batch
    for key, value, phrase in steps:
        if settings[key] != value:
            settings[key] = value
            suggestions.append(phrase)
            if memory_plan(shape, seq, batch, **settings)["fits"]:
                return suggestions
    while batch > 1:
        batch //= 2
        if memory_plan(shape, seq, batch, **settings)["fits"]:
            return suggestions + [f"micro-batch {batch}, accumulating {micro_batch // batch} of them per step"]
    settings["offload"] = True
    suggestions.append(f"micro-batch {batch} and CPU offload of the model states")
    if memory_plan(shape, seq, batch, **settings)["fits"]:
        return suggestions
    return suggestions + ["still does not fit: add tensor or pipeline parallel ranks, or GPUs"]
