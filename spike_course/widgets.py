"""ipywidgets explorers built on ``costmodel`` and ``viz``.

Each explorer is a function that builds the controls and hands them, with a ``draw``
function of their values, to ``ipywidgets.interactive_output``: it redraws on every
change and draws once right away (so a headless run under nbval still shows a real plot).
The explorer returns the controls and the output laid out in one box.
"""

from __future__ import annotations


# --- chapter 06: fully sharded data parallel (ZeRO memory explorer) ---


def zero_explorer(billions: float = 7.5, dp_size: int = 64, stage: int = 3, k: float = 12,
                  capacity_gb: float = 80.0):
    """Sliders for model size (billions of parameters), N_d and the ZeRO stage; bars of
    the bytes per device that each stage needs (``costmodel.zero_memory_breakdown``),
    the chosen stage framed, and one device's memory as a dashed line."""
    import ipywidgets as w
    from IPython.display import display

    import matplotlib.pyplot as plt

    from .costmodel import zero_memory_breakdown
    from .viz import zero_memory_bars

    size = w.FloatLogSlider(value=billions, base=10, min=-1, max=3, step=0.05,
                            description="params (B)", continuous_update=False)
    ranks = w.SelectionSlider(options=[2 ** i for i in range(11)], value=dp_size,
                              description="N_d", continuous_update=False)
    chosen = w.ToggleButtons(options=[("stage 0", 0), ("stage 1", 1), ("stage 2", 2),
                                      ("stage 3", 3)], value=stage, description="ZeRO")

    def draw(billions, dp_size, stage):
        bars = {f"stage {s}": zero_memory_breakdown(billions * 1e9, dp_size, s, k) for s in range(4)}
        fig = zero_memory_bars(bars, highlight=f"stage {stage}", capacity=capacity_gb * 1e9,
                               title=f"{billions:,.3g}B parameters, N_d = {dp_size}, K = {k:g}")
        plt.close(fig)  # shown once, inside the widget, not again by the inline backend
        display(fig)

    out = w.interactive_output(draw, {"billions": size, "dp_size": ranks, "stage": chosen})
    return w.VBox([w.HBox([size, ranks]), chosen, out])


# --- chapter 08: communication and hardware (a parallelism decision guide) ---


def strategy_table(rows) -> str:
    """``costmodel.plan_parallelism`` rows as an HTML table (memory, traffic, compute, why)."""
    import html

    head = ("<tr><th></th><th>strategy</th><th>model states / GPU</th><th>fits</th>"
            "<th>comm / step</th><th>compute / step</th><th>comm : compute</th><th>why</th></tr>")
    body = "".join(
        f"<tr><td>{'&#9733;' if r['recommended'] else ''}</td><td>{html.escape(r['strategy'])}</td>"
        f"<td>{r['memory'] / 1e9:,.1f} GB</td><td>{'yes' if r['fits'] else 'no'}</td>"
        f"<td>{r['comm'] * 1e3:,.2f} ms</td><td>{r['compute'] * 1e3:,.2f} ms</td>"
        f"<td>{r['comm'] / r['compute']:.2f}</td><td style='text-align:left'>{html.escape(r['why'])}</td></tr>"
        for r in rows)
    return f"<table>{head}{body}</table>"


def parallelism_guide(billions: float = 7.0, tokens_per_gpu: int = 16384, gpu_memory_gb: float = 180,
                      num_gpus: int = 8, link: str = "nvlink5"):
    """Sliders for model size, tokens per GPU per step, GPU memory, GPU count and link; a
    table and bars from ``costmodel.plan_parallelism`` that say which strategy fits and why."""
    import ipywidgets as w
    from IPython.display import HTML, display

    import matplotlib.pyplot as plt

    from .costmodel import ACTIVATION_HEADROOM, plan_parallelism
    from .viz import strategy_bars

    size = w.FloatLogSlider(value=billions, base=10, min=-2, max=3, step=0.05,
                            description="params (B)", continuous_update=False)
    tokens = w.SelectionSlider(options=[2 ** i for i in range(9, 19)], value=tokens_per_gpu,
                               description="tokens/GPU", continuous_update=False)
    memory = w.SelectionSlider(options=[24, 40, 48, 80, 94, 141, 180], value=gpu_memory_gb,
                               description="GPU GB", continuous_update=False)
    gpus = w.SelectionSlider(options=[2, 4, 8, 16, 32, 64, 128, 256], value=num_gpus,
                             description="GPUs", continuous_update=False)
    links = w.ToggleButtons(options=[("NVLink 5", "nvlink5"), ("PCIe Gen5", "pcie5")], value=link,
                            description="link")

    def draw(billions, tokens_per_gpu, gpu_memory_gb, num_gpus, link):
        rows = plan_parallelism(billions * 1e9, tokens_per_gpu, num_gpus, gpu_memory_gb * 1e9, link)
        fig = strategy_bars(rows, gpu_memory_gb * 1e9, ACTIVATION_HEADROOM * gpu_memory_gb * 1e9,
                            title=f"{billions:,.3g}B parameters on {num_gpus} GPUs of "
                                  f"{gpu_memory_gb} GB over {links.label}")
        plt.close(fig)
        display(HTML(strategy_table(rows)))
        display(fig)

    out = w.interactive_output(draw, {"billions": size, "tokens_per_gpu": tokens, "gpu_memory_gb": memory,
                                      "num_gpus": gpus, "link": links})
    return w.VBox([w.HBox([size, tokens]), w.HBox([memory, gpus]), links, out])


# --- chapter 01: message passing (all-reduce algorithms explorer) ---


def allreduce_explorer(nbytes: float = 100e6, world_size: int = 8, link: str = "NVLink 5",
                       alpha_us: float = 5.0):
    """Sliders for the message size, the world size, the link and the latency; curves of
    naive, ring and tree all-reduce times (``costmodel.allreduce_time``) and a line of
    text with each algorithm's time and bus bandwidth at the chosen point."""
    import ipywidgets as w
    from IPython.display import display

    import matplotlib.pyplot as plt

    from .costmodel import ALLREDUCE_ALGORITHMS, allreduce_time, bus_bandwidth, link_bandwidth
    from .viz import allreduce_cost_curves

    links = {"NVLink 5": link_bandwidth("nvlink5"), "PCIe 5 x16": link_bandwidth("pcie5")}
    size = w.FloatLogSlider(value=nbytes, base=10, min=2, max=10, step=0.1,
                            description="bytes", continuous_update=False)
    ranks = w.IntSlider(value=world_size, min=2, max=128, description="ranks",
                        continuous_update=False)
    chosen = w.ToggleButtons(options=list(links), value=link, description="link")
    latency = w.FloatLogSlider(value=alpha_us, base=10, min=-1, max=2, step=0.1,
                               description="alpha (us)", continuous_update=False)
    summary = w.HTML()

    def draw(nbytes, world_size, link, alpha_us):
        alpha, beta = alpha_us * 1e-6, 1 / links[link]
        cells = []
        for algorithm in ALLREDUCE_ALGORITHMS:
            seconds = allreduce_time(nbytes, world_size, algorithm, alpha, beta)
            busbw = bus_bandwidth(nbytes, seconds, world_size, "all_reduce")
            cells.append(f"<b>{algorithm}</b> {seconds * 1e3:,.3f} ms (busbw {busbw / 1e9:,.1f} GB/s)")
        summary.value = " &nbsp;|&nbsp; ".join(cells)
        fig = allreduce_cost_curves(nbytes, world_size, alpha, beta, title=f"all-reduce over {link}"
                                    f" ({links[link] / 1e9:,.0f} GB/s each way), alpha = {alpha_us:.3g} us")
        plt.close(fig)  # shown once, inside the widget, not again by the inline backend
        display(fig)

    out = w.interactive_output(draw, {"nbytes": size, "world_size": ranks, "link": chosen,
                                      "alpha_us": latency})
    return w.VBox([w.HBox([size, ranks]), w.HBox([chosen, latency]), summary, out])


# --- chapter 00: welcome (a look at the digits) ---


def digit_explorer(dataset, per_page: int = 8):
    """Page through a digits dataset: a slider picks the first sample, a row of images shows it."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    start = w.IntSlider(value=0, min=0, max=max(0, len(dataset) - per_page), step=per_page,
                        description="first sample", continuous_update=False)

    def draw(first):
        fig, axes = plt.subplots(1, per_page, figsize=(per_page, 1.4))
        for offset, ax in enumerate(axes):
            image, label = dataset[first + offset]
            ax.imshow(image[0], cmap="gray")
            ax.set_title(f"#{first + offset}: {label}", fontsize=8)
            ax.axis("off")
        plt.show()

    out = w.interactive_output(draw, {"first": start})
    box = w.VBox([start, out])
    box.add_class("spike-course-explorer")
    return box


# --- chapter 11: making a model fit (a memory planner) ---


def memory_planner(model: str = "Llama 3 8B", seq: int = 8192, micro_batch: int = 2, dp: int = 8,
                   tp: int = 1, pp: int = 1, shard: int = 8, gpu_share: float = 1.0,
                   precision: str = "bf16", checkpoint: bool = False, offload: bool = False):
    """Model, sequence length, micro-batch, mesh (dp, tp, pp, F), GPU (a B200 or a Run:ai
    share of one) and the memory tools in; ``costmodel.memory_plan``'s bytes per rank by
    kind, "fits" or not, and ``costmodel.fit_suggestions`` out."""
    import html

    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import HTML, display

    from .costmodel import B200_MEMORY, MODEL_SHAPES, fit_suggestions, memory_plan
    from .viz import WITH_ACTIVATIONS, zero_memory_bars

    powers = [2 ** i for i in range(8)]
    controls = dict(
        model=w.Dropdown(options=list(MODEL_SHAPES), value=model, description="model"),
        seq=w.SelectionSlider(options=[2 ** i for i in range(4, 18)], value=seq, description="seq len"),
        micro_batch=w.SelectionSlider(options=powers, value=micro_batch, description="micro-batch"),
        dp=w.SelectionSlider(options=powers, value=dp, description="dp"),
        tp=w.SelectionSlider(options=powers[:4], value=tp, description="tp"),
        pp=w.SelectionSlider(options=powers[:4], value=pp, description="pp"),
        shard=w.SelectionSlider(options=powers, value=shard, description="F (shard)"),
        gpu_share=w.SelectionSlider(options=[0.125, 0.25, 0.5, 1.0], value=gpu_share,
                                    description="B200 share"),
        precision=w.ToggleButtons(options=[("fp32", "fp32"), ("bf16 autocast", "autocast"),
                                           ("bf16 mixed (FSDP)", "bf16")], value=precision),
        checkpoint=w.Checkbox(value=checkpoint, description="activation checkpointing"),
        offload=w.Checkbox(value=offload, description="CPU offload"),
    )

    def draw(model, seq, micro_batch, dp, tp, pp, shard, gpu_share, precision, checkpoint, offload):
        settings = dict(dp=dp, tp=tp, pp=pp, shard=min(shard, dp), precision=precision,
                        checkpoint=checkpoint, offload=offload, gpu_memory=gpu_share * B200_MEMORY)
        if dp % settings["shard"] or MODEL_SHAPES[model][0] % pp:
            display(HTML("<b>F must divide dp, and pp the number of layers.</b>"))
            return
        plan = memory_plan(model, seq, micro_batch, **settings)
        tips = fit_suggestions(model, seq, micro_batch, **settings)
        verdict = "fits" if plan["fits"] else "does NOT fit"
        text = (f"<b>{plan['total'] / 1e9:,.1f} GB per rank: {verdict}</b> in {plan['budget'] / 1e9:,.0f} GB "
                f"(90% of {gpu_share:g} x 180 GB); {dp * tp * pp} GPUs"
                + (f"; {plan['host'] / 1e9:,.1f} GB of model states in host memory" if offload else ""))
        if tips:
            text += "<br>to make it fit: " + " + ".join(html.escape(t) for t in tips)
        display(HTML(text))
        fig = zero_memory_bars({"per rank": plan}, capacity=plan["budget"], kinds=WITH_ACTIVATIONS,
                               title=f"{model}, seq {seq}, micro-batch {micro_batch}")
        plt.close(fig)  # shown once, by display, not again by the inline backend
        display(fig)

    out = w.interactive_output(draw, controls)
    c = controls
    return w.VBox([w.HBox([c["model"], c["gpu_share"]]), w.HBox([c["seq"], c["micro_batch"]]),
                   w.HBox([c["dp"], c["shard"]]), w.HBox([c["tp"], c["pp"]]), c["precision"],
                   w.HBox([c["checkpoint"], c["offload"]]), out])
