"""The rendered edition's widgets, drawn once on the page instead of left empty.

A widget redraws only with a kernel behind it, and the scripts that would show even its
controls come from a CDN: in the edition, read offline as often as not, a chapter's explorer
or calculator was an empty cell. The executed notebook keeps every widget's state, and with
it what each of its Output areas showed when the cell ran: the first drawing, for the
controls' default values. ``show_widgets_drawn`` (run on Sphinx's ``doctree-read``) puts that
drawing in place of each widget, under a line that gives the controls' values and says the
widget is interactive in JupyterLab; the page loads no widget script (``CONF`` in ``edition``).
"""

from __future__ import annotations

import base64
import html
import json
import re

WIDGET_VIEW = re.compile(r'<script type="application/vnd.jupyter.widget-view\+json">(.*?)</script>', re.S)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def show_widgets_drawn(app, doctree) -> None:
    """Replace each widget view of the page just read by its first drawing (see above)."""
    from docutils import nodes
    from myst_nb.sphinx_ import NbMetadataCollector

    state = NbMetadataCollector.get_js_files(app.env, app.env.docname).pop("ipywidgets_state", None)
    models = json.loads(state[1]["body"])["state"] if state else {}
    for raw in list(doctree.findall(nodes.raw)):
        view = WIDGET_VIEW.search(raw.astext())
        if view:
            raw.replace_self(drawn(models, json.loads(view.group(1))["model_id"]))


def _tree(models: dict, model_id: str) -> list[dict]:
    """The states of a widget and of all its children, depth first."""
    model = models.get(model_id)
    if model is None:
        return []
    found = [model]
    for child in model["state"].get("children", []):
        found += _tree(models, child.removeprefix("IPY_MODEL_"))
    return found


def _value(state: dict) -> str:
    labels = state.get("_options_labels")
    if labels and state.get("index") is not None:
        return str(labels[state["index"]])
    return f"{state['value']:g}" if isinstance(state.get("value"), float) else str(state.get("value"))


def controls_line(models: dict, model_id: str) -> str:
    """'Interactive in JupyterLab ... drawn for a = 1, b = 2': the controls' values."""
    controls = [m["state"] for m in _tree(models, model_id)
                if m["state"].get("description") and ("value" in m["state"] or "index" in m["state"])]
    values = ", ".join(f"{c['description']} = {_value(c)}" for c in controls)
    return ("Interactive in JupyterLab, where each change of a control redraws it; here as first drawn"
            + (f", for {values}." if values else "."))


def drawn(models: dict, model_id: str):
    """A docutils container: the controls line, then every output the widget's Output areas hold."""
    from docutils import nodes

    box = nodes.container(classes=["cell_output", "widget-drawn"])
    box += nodes.paragraph(text=controls_line(models, model_id), classes=["widget-note"])
    for model in _tree(models, model_id):
        for output in model["state"].get("outputs", []) if model["model_name"] == "OutputModel" else []:
            box += _output(output)
    return box


def _output(output: dict):
    """One saved output (stream, display data, result or error) as a docutils node."""
    from docutils import nodes

    data = output.get("data", {})
    if output["output_type"] == "stream":
        text = output["text"]
    elif output["output_type"] == "error":
        text = ANSI.sub("", "\n".join(output.get("traceback", [])))
    elif "image/png" in data:
        png = data["image/png"]
        png = png if isinstance(png, str) else base64.b64encode(png).decode()
        alt = html.escape(str(data.get("text/plain", "figure")))
        return nodes.raw("", f'<img src="data:image/png;base64,{png.strip()}" alt="{alt}">', format="html")
    elif "text/html" in data:
        return nodes.raw("", "".join(data["text/html"]), format="html")
    else:
        text = "".join(data.get("text/plain", ""))
    text = "".join(text)
    block = nodes.literal_block(text, text, classes=["output", "text_plain"])
    block["language"] = "none"  # printed text, not code to highlight
    return block
