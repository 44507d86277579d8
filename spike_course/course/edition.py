"""The rendered edition: every lecture executed and published as a Sphinx site.

    spike-course html [--out _build/html]

The stack is Jupyter Book 1's: myst-nb executes the notebooks and sphinx-book-theme
gives the contents sidebar, previous/next links and search. There is no conf.py to keep:
``CONF`` below is the whole configuration, and ``index.md`` is written on each build with
the chapters in order and a table of how long each one ran. The Sphinx source folder is
``WORK/source``: that ``index.md`` and a link to ``notebooks/``, so each notebook runs in
its own folder (as in JupyterLab: its worker scripts land in ``notebooks/workers/``).

Executed notebooks are kept in a jupyter-cache under ``WORK/jupyter_cache``: a lecture
runs again only when one of its code cells changed (or its last run failed).

The maths is typeset by MathJax served from the site itself (``_static/mathjax/``, the copy
that the Jupyter project ships as ``jupyter-server-mathjax``), not from a CDN: the edition
is read in workshop rooms and on clusters' login nodes, offline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest import mock

from . import run_times
from ..lab.headless import private_kernels
from ..notebook import describe_devices
from ..widget_pages import show_widgets_drawn

CONF = {
    "project": "spike-course",
    "html_title": "Distributed PyTorch on (fractions of) GPUs",
    "extensions": ["myst_nb"],
    "html_theme": "sphinx_book_theme",
    # One search box, the sidebar's: the pydata theme underneath would add a second one in a
    # header bar of its own (sphinx-book-theme's empty default for it no longer reaches it).
    "html_theme_options": {"navbar_persistent": []},
    "myst_enable_extensions": ["dollarmath"],  # $m$ in markdown cells, as JupyterLab shows it
    # index.md and the lectures; not the workers, data or figures the notebooks write.
    "include_patterns": ["index.md", "notebooks/[0-9][0-9]_*.ipynb"],
    "nb_execution_mode": "cache",
    "nb_execution_in_temp": False,  # run in the notebook's folder: workers/NN_topic/... is relative
    "nb_execution_show_tb": True,   # a failing cell's traceback goes into the build log
    # %%writefile cells hold C or shell that the ipython3 highlighter cannot lex: harmless.
    "suppress_warnings": ["misc.highlighting_failure"],
    # MathJax 2 from _static/mathjax/ (see mathjax_folder). myst marks the pages' text
    # tex2jax_ignore and its formulas "math": typeset those only, as \( \) and \[ \] (the
    # delimiters Sphinx writes), in the web font the package ships (no image fonts there).
    # Widgets are drawn once on the page (widget_pages), with no ipywidgets script from a CDN.
    "nb_ipywidgets_js": {},
    "mathjax_path": "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full",
    "mathjax2_config": {
        "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]],
                    "processClass": "math", "ignoreClass": "tex2jax_ignore"},
        "HTML-CSS": {"availableFonts": [], "preferredFont": None, "webFont": "STIX-Web", "imageFont": None},
    },
}

INDEX = """\
# Distributed PyTorch on (fractions of) GPUs

The rendered edition of spike-course: every lecture executed on {devices},
with its outputs and figures.

```{{toctree}}
:caption: Chapters
:maxdepth: 1

{chapters}
```

## Run times

Seconds each lecture took to run here, when it last ran (a lecture whose code did not
change since comes from the cache).

```{{nb-exec-table}}
```
"""


def write_source(notebooks: Path, source: Path) -> list[str]:
    """Write ``source/index.md`` and link ``source/notebooks`` to the lectures; return
    the chapters' document names in order."""
    source.mkdir(parents=True, exist_ok=True)
    link = source / "notebooks"
    link.unlink(missing_ok=True)
    link.symlink_to(notebooks.resolve(), target_is_directory=True)
    chapters = [f"notebooks/{path.stem}" for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb"))]
    index, text = source / "index.md", INDEX.format(devices=describe_devices(), chapters="\n".join(chapters))
    if not index.exists() or index.read_text() != text:  # else Sphinx would read it again
        index.write_text(text)
    return chapters


def mathjax_folder(static: Path) -> Path:
    """Link ``static/mathjax`` to the MathJax that jupyter-server-mathjax installs, so that
    Sphinx copies it to the site's ``_static/mathjax/``; return ``static``."""
    import jupyter_server_mathjax

    static.mkdir(parents=True, exist_ok=True)
    link = static / "mathjax"
    link.unlink(missing_ok=True)
    link.symlink_to(Path(jupyter_server_mathjax.__file__).parent / "static", target_is_directory=True)
    return static


def _exec_data(env, docname: str) -> dict:
    from myst_nb.sphinx_ import NbMetadataCollector

    return NbMetadataCollector.get_exec_data(env, docname) or {}


def build_site(notebooks: Path, out_dir: Path, work_dir: Path, timeout: int = 600) -> list[str]:
    """Build the site from the lectures in ``notebooks`` into ``out_dir``; print each
    chapter's run time and return the chapters whose notebook failed."""
    from sphinx.application import Sphinx
    from sphinx.util.docutils import docutils_namespace, patch_docutils

    chapters = write_source(notebooks, work_dir / "source")
    conf = dict(CONF, nb_execution_timeout=timeout, nb_execution_cache_path=str(work_dir / "jupyter_cache"),
                html_static_path=[str(mathjax_folder(work_dir / "static"))])
    # As sphinx-build does: docutils' directives and roles registered for this build only.
    # Without MPLBACKEND the kernels myst-nb starts draw inline: a cluster shell's
    # MPLBACKEND=Agg would publish pages without figures (notebook.show_figures_inline does
    # the same for a learner's kernel).
    without_backend = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    started = time.time()
    with mock.patch.dict(os.environ, without_backend, clear=True), private_kernels(), \
            patch_docutils(work_dir / "source"), docutils_namespace():
        app = Sphinx(srcdir=work_dir / "source", confdir=None, outdir=out_dir, doctreedir=work_dir / "doctrees",
                     buildername="html", confoverrides=conf)
        # A failed run is not cached, and Sphinx would not read an unchanged notebook again:
        # ask for it, so that the next build retries it instead of showing the old failure.
        app.connect("env-get-outdated", lambda app, env, *changes:
                    [doc for doc in chapters if _exec_data(env, doc).get("succeeded") is False])
        app.connect("doctree-read", show_widgets_drawn)
        app.build()

    failed = _say_how_each_ran(app.env, chapters)
    if run_times.recording():
        _record_run_times(app.env, chapters, notebooks, started)
    figures = save_chapter_figures(notebooks, work_dir / "jupyter_cache", out_dir / "figures")
    print(f"wrote {out_dir / 'index.html'} and {len(figures)} chapter figures in {out_dir / 'figures'}")
    return failed


def _say_how_each_ran(env, chapters) -> list[str]:
    """Print each chapter's run time, or its failure; return the chapters that failed."""
    failed = []
    for doc in chapters:
        data = _exec_data(env, doc)
        if data.get("succeeded"):
            print(f"{doc}: {data['runtime']:.0f} s")
        else:
            print(f"{doc}: FAILED {data.get('error') or 'not executed'} (traceback in the log above)")
            failed.append(doc)
    return failed


def _record_run_times(env, chapters, notebooks: Path, started: float) -> None:
    """Record in ``notebooks/run_times.json`` the lectures this build executed (not those from
    the cache) and, when it executed every one of them, the build's own time."""
    ran = {doc.split("/")[-1]: data["runtime"] for doc in chapters
           if (data := _exec_data(env, doc)).get("succeeded") and data["mtime"] >= started}
    whole = {"make html": time.time() - started} if len(ran) == len(chapters) else {}
    run_times.record(notebooks / run_times.FILE.name, ran, whole)
    print(f"recorded the run times of {len(ran)} lectures" + (" and of the whole build" if whole else "")
          + f" in {notebooks / run_times.FILE.name}")


def save_chapter_figures(notebooks: Path, cache: Path, target: Path) -> list[Path]:
    """For the README's chapter map: each executed lecture's first image of a cell tagged
    ``chapter-figure`` (else its first image), from the cache, as ``target/NN_topic.png``."""
    import base64

    from jupyter_cache import get_cache

    cache, saved = get_cache(cache), []
    for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        try:
            _, notebook = cache.merge_match_into_file(str(path))
        except KeyError:  # not executed successfully: no figure
            continue
        cells = [c for c in notebook.cells if c.cell_type == "code"]
        tagged = [c for c in cells if "chapter-figure" in c.metadata.get("tags", [])]
        image = next((o["data"]["image/png"] for c in tagged + cells for o in c.get("outputs", [])
                      if "image/png" in o.get("data", {})), None)
        if image:
            target.mkdir(parents=True, exist_ok=True)
            saved.append(target / f"{path.stem}.png")
            saved[-1].write_bytes(base64.b64decode(image))
    return saved
