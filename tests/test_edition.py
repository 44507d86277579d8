"""The rendered edition, built from three tiny lectures: pages in order, previous/next
links, search, the figure, run times, the notebook's own folder as its working directory,
a failing lecture reported (and run again next time), the cache that makes a second
build skip the lectures that passed, a formula typeset in a browser with the network off, a
widget drawn once on the page, one search box, and kernels that say nothing of TCP."""

import os
import shutil
from unittest import mock

import nbformat
import pytest

from spike_course.course import edition, run_times

pytestmark = pytest.mark.processes  # most tests here start ranks, torchrun or kernels

FIGURE = """\
import matplotlib.pyplot as plt

plt.plot([0, 1], [1, 0])
plt.show()"""


FORMULAS = "A tree takes $2\\lceil\\log_2 N\\rceil$ rounds, a ring\n\n$$2(N-1)\\left(\\alpha + \\frac{n}{N}\\beta\\right)$$"


# A chapter's explorer: a control and what its draw function prints and plots.
WIDGET = """\
import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

gpus = w.SelectionSlider(options=[1, 2, 4, 8], value=4, description="GPUs")


def draw(gpus):
    print(f"{gpus} GPUs: {100 / gpus:g} hours")
    plt.plot([1, gpus], [100, 100 / gpus])
    plt.show()


display(w.VBox([gpus, w.interactive_output(draw, {"gpus": gpus})]))"""


def _lecture(path, title, code, text="text"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\n{text}"), nbformat.v4.new_code_cell(code)]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    (root / "notebooks").mkdir()
    # Written relative to the working directory, as chapters write workers/NN_topic/...
    _lecture(root / "notebooks" / "00_first.ipynb", "00 · First", "open('here.txt', 'w').write('x')")
    _lecture(root / "notebooks" / "01_second.ipynb", "01 · Second", FIGURE, FORMULAS)
    _lecture(root / "notebooks" / "02_broken.ipynb", "02 · Broken", "open('fixed.txt').read()")
    _lecture(root / "notebooks" / "03_widget.ipynb", "03 · Widget", WIDGET)
    # As from a cluster shell, which often exports MPLBACKEND=Agg: the figure must still show.
    # and asked to record the run times, as make run-times does
    with mock.patch.dict(os.environ, {"MPLBACKEND": "Agg", run_times.RECORD_ENV: "1"}):
        failed = edition.build_site(root / "notebooks", root / "html", root / "work")
    return root, failed


def test_lectures_run_in_their_own_folder_and_a_failure_is_reported(site):
    root, failed = site
    assert failed == ["notebooks/02_broken"]
    assert (root / "notebooks" / "here.txt").exists()


def test_the_lectures_it_ran_are_recorded_with_the_machine(site):
    """The lectures that passed, each with its time and this machine; not the build's own
    time, as one lecture failed (a later build that takes the others from the cache records
    only what it runs)."""
    root, _ = site
    data = run_times.load(root / "notebooks" / "run_times.json")
    assert sorted(data["lectures"]) == ["00_first", "01_second", "03_widget"]
    assert all(0 < e["seconds"] < 120 and e["machine"] == run_times.machine()
               for e in data["lectures"].values()), (data, run_times.machine())
    assert data["builds"] == {}


def test_index_lists_the_chapters_in_order_with_run_times(site):
    root, _ = site
    index = (root / "html" / "index.html").read_text()
    assert index.index('href="notebooks/00_first.html"') < index.index('href="notebooks/01_second.html"')
    assert "Run Time (s)" in index and "✅" in index and "❌" in index


def test_pages_link_to_the_previous_and_next_chapter(site):
    root, _ = site
    first = (root / "html" / "notebooks" / "00_first.html").read_text()
    second = (root / "html" / "notebooks" / "01_second.html").read_text()
    assert '<link rel="next" title="01 · Second" href="01_second.html"' in first
    assert '<link rel="prev" title="00 · First" href="00_first.html"' in second


def test_search_and_the_figure_are_there(site):
    root, _ = site
    assert (root / "html" / "search.html").exists()
    assert "Second" in (root / "html" / "searchindex.js").read_text()
    second = (root / "html" / "notebooks" / "01_second.html").read_text()
    images = list((root / "html" / "_images").glob("*.png"))
    assert len(images) == 1 and f"_images/{images[0].name}" in second
    # and the chapter figure for the README's map, the same picture
    figures = sorted(p.name for p in (root / "html" / "figures").glob("*.png"))
    assert figures == ["01_second.png"]
    assert (root / "html" / "figures" / "01_second.png").read_bytes() == images[0].read_bytes()


def test_a_second_build_comes_from_the_cache_and_retries_the_failure(site):
    root, _ = site
    (root / "notebooks" / "here.txt").unlink()
    (root / "notebooks" / "fixed.txt").write_text("x")
    # Sphinx reads a changed notebook again; its code did not change, so it is not run.
    (root / "notebooks" / "00_first.ipynb").touch()
    with mock.patch.dict(os.environ, {run_times.RECORD_ENV: "1"}):
        assert edition.build_site(root / "notebooks", root / "html", root / "work") == []
    assert not (root / "notebooks" / "here.txt").exists()
    assert sorted(run_times.load(root / "notebooks" / "run_times.json")["lectures"]) == [
        "00_first", "01_second", "02_broken", "03_widget"]


def test_a_formula_renders_with_the_network_off(site):
    """The maths of a chapter typesets in a browser that can reach nothing but the site's own
    files (a workshop room, a cluster's login node): MathJax comes from _static/mathjax/."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.skip("no Chromium: apt-get install chromium chromium-driver (CI does)")
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import sync_playwright

    from test_browser import CHROMIUM_FLAGS

    root, _ = site
    page_file = root / "html" / "notebooks" / "01_second.html"
    assert 'src="../_static/mathjax/MathJax.js' in page_file.read_text()
    asked_outside = []

    def only_files(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            asked_outside.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        context = browser.new_context(offline=True)
        context.route("**/*", only_files)
        page = context.new_page()
        page.goto(page_file.as_uri())
        # MathJax's typeset output (HTML-CSS): one span.MathJax per formula, the display one
        # in a div.MathJax_Display
        page.locator("span.MathJax").nth(1).wait_for(state="attached", timeout=60_000)
        typeset, display = page.locator("span.MathJax").count(), page.locator("div.MathJax_Display").count()
        text = page.locator("section").first.inner_text()
        browser.close()
    assert (typeset, display) == (2, 1)
    assert "\\lceil" not in text and "$" not in text  # no raw LaTeX left on the page
    assert asked_outside == []


def test_a_widget_is_drawn_once_on_the_page_and_called_interactive(site):
    root, _ = site
    page = (root / "html" / "notebooks" / "03_widget.html").read_text()
    assert "Interactive in JupyterLab" in page and "for GPUs = 4." in page
    assert "4 GPUs: 25 hours" in page and '<img src="data:image/png;base64,' in page
    assert "widget-view+json" not in page and "widget-state+json" not in page
    assert 'src="http' not in page  # no ipywidgets script from a CDN: the page reads offline


def test_a_page_has_one_search_box(site):
    root, _ = site
    assert (root / "html" / "notebooks" / "01_second.html").read_text().count("search-button-field") == 1


def test_the_kernels_of_a_build_listen_on_private_sockets():
    """ipykernel warns, for every kernel on TCP, that the notebook travels unencrypted: make html
    printed it once per chapter. Every kernel that nbclient makes inside private_kernels() listens
    on sockets in a private folder instead."""
    from nbclient import NotebookClient

    from spike_course.lab.headless import private_kernels

    with private_kernels():
        kernels = [NotebookClient(nbformat.v4.new_notebook(), kernel_name="python3").create_kernel_manager()
                   for _ in range(2)]
    assert [k.transport for k in kernels] == ["ipc", "ipc"]
    assert kernels[0].ip != kernels[1].ip and "spike-course-kernels-" in kernels[0].ip
    assert NotebookClient(nbformat.v4.new_notebook(), kernel_name="python3").create_kernel_manager().transport == "tcp"
