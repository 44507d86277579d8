"""The rendered edition: execute every lecture and write static HTML with an index page.

    spike-course html [--out _build/html] [--with-solutions]

Each notebook runs in its own folder (as in JupyterLab, so its worker scripts land in
``workers/``), then nbconvert turns the executed copy into HTML with its outputs,
figures and widget state. ``index.html`` lists the chapters in order with their titles
and how long each took to run, which is also the cheapest way to see whether every
chapter still fits the time budget.
"""

from __future__ import annotations

import html
from pathlib import Path

from .notebook import describe_devices


def title_of(notebook, fallback: str) -> str:
    """The first markdown heading of a notebook, without its '#'."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


def save_chapter_figure(notebook, target: Path) -> Path | None:
    """Save the figure that stands for a chapter: the first image of a cell tagged
    ``chapter-figure``, else the notebook's first image (used for the README's map)."""
    import base64

    cells = [c for c in notebook.cells if c.cell_type == "code"]
    tagged = [c for c in cells if "chapter-figure" in c.metadata.get("tags", [])]
    for cell in tagged + cells:
        for output in cell.get("outputs", []):
            image = output.get("data", {}).get("image/png")
            if image:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(image))
                return target
    return None


def render(path: Path, out_dir: Path, timeout: int = 600) -> dict:
    """Execute one notebook and write its HTML; return what the index needs to know."""
    from nbconvert import HTMLExporter

    from .headless import run_notebook

    run = run_notebook(path, timeout)  # a failure keeps what ran: the page shows where it stopped
    notebook, error, seconds = run.notebook, run.error, run.seconds
    figure = save_chapter_figure(notebook, out_dir / "figures" / path.parent.name / f"{path.stem}.png")
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(notebook)
    target = out_dir / path.parent.name / f"{path.stem}.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(body)
    return {"title": title_of(notebook, path.stem), "href": f"{path.parent.name}/{path.stem}.html",
            "seconds": seconds, "error": error, "folder": path.parent.name,
            "figure": figure.relative_to(out_dir).as_posix() if figure else None}


def write_index(pages: list[dict], out_dir: Path) -> Path:
    rows = []
    for page in pages:
        status = (f'<span class="bad">failed: {html.escape(page["error"])}</span>' if page["error"]
                  else f'{page["seconds"]:.0f} s')
        figure = f'<img src="{page["figure"]}" height="90">' if page["figure"] else ""
        rows.append(f'<tr><td><a href="{page["href"]}">{html.escape(page["title"])}</a></td>'
                    f'<td>{page["folder"]}</td><td>{status}</td><td>{figure}</td></tr>')
    index = out_dir / "index.html"
    index.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>spike-course: distributed PyTorch</title>
<style>body{{font-family:sans-serif;max-width:52em;margin:2em auto;line-height:1.5}}
td{{padding:.2em 1em .2em 0}} .bad{{color:#b00}}</style></head><body>
<h1>Distributed PyTorch on (fractions of) GPUs</h1>
<p>The rendered edition of the course: every notebook executed on {html.escape(describe_devices())},
with its outputs and figures. The times are what each notebook took to run here.</p>
<table><tr><th>chapter</th><th>part</th><th>run time</th><th></th></tr>
{chr(10).join(rows)}
</table></body></html>
""")
    return index


def build_site(root: Path, out_dir: Path, with_solutions: bool = False, timeout: int = 600) -> list[dict]:
    folders = ["notebooks"] + (["solutions"] if with_solutions else [])
    pages = []
    for folder in folders:
        for path in sorted((root / folder).glob("*.ipynb")):
            print(f"running {folder}/{path.name} ...", flush=True)
            page = render(path, out_dir, timeout)
            print(f"  {'FAILED ' + page['error'] if page['error'] else 'ok'} in {page['seconds']:.0f} s", flush=True)
            pages.append(page)
    index = write_index(pages, out_dir)
    print(f"wrote {index} ({len(pages)} pages, {sum(p['seconds'] for p in pages):.0f} s of notebooks)")
    return pages
