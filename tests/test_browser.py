"""The course as a learner meets it: JupyterLab in a real (headless) browser.

Starts JupyterLab the way ``make lab`` does (``spike-course lab``, localhost, a token),
opens the welcome notebook in Chromium, runs all cells, and checks what a learner
should see: a launched worker's rank-tagged output, a matplotlib figure, a rendered
ipywidgets explorer (not its text fallback) and the per-rank progress bars. The
screenshot (explorer and progress bars) goes to ``_build/browser/``.

Needs Debian's Chromium (``apt-get install chromium``, which ``.ci/run`` does) and the
``playwright`` package; without them the test is skipped, and says so.
"""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from lab_server import running_lab

import course_files

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NOTEBOOK = "notebooks/00_welcome_and_setup.ipynb"
SHOTS = ROOT / "_build" / "browser"
# Flags for a root, offline, headless Chromium: no sandbox, no calls home.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.browser, pytest.mark.processes]  # JupyterLab and Chromium


@pytest.fixture
def jupyterlab(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium: apt-get install chromium chromium-driver (CI does)")
    pytest.importorskip("playwright.sync_api")
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Render every cell into the page, not only those scrolled into view, so the test can find them.
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = {"JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "SPIKE_COURSE_DATA": "synthetic"}
    with running_lab(tmp_path, [NOTEBOOK], env) as (url, token):
        yield url, token


def _accept_kernel(page, seconds: float = 90):
    """Wait until the notebook's kernel is idle, accepting the "Select Kernel" dialog that
    JupyterLab sometimes shows for a notebook opened the first time."""
    deadline, quiet = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        accept = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click()
            quiet = 0
        elif page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count():
            quiet += 1
            if quiet >= 3:  # idle, and no dialog for three seconds in a row
                return
        time.sleep(1)
    raise AssertionError("the notebook's kernel did not start")


def _run_all_cells(playwright, url, token, notebook):
    """(browser, page): Chromium with ``notebook`` open in JupyterLab, its kernel started and
    Run All Cells clicked, as a learner does it."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
    page = browser.new_page(viewport={"width": 1280, "height": 1900})
    page.goto(f"{url}/lab/tree/{notebook}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    _accept_kernel(page)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    return browser, page


def test_welcome_notebook_runs_in_jupyterlab(jupyterlab):
    from playwright.sync_api import expect, sync_playwright

    url, token = jupyterlab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser, page = _run_all_cells(p, url, token, NOTEBOOK)
        explorer = page.locator(".spike-course-explorer")
        progress = page.locator(".spike-course-progress")
        try:
            # The last worker's check prints this line; wait for it, then for the kernel to be idle.
            page.wait_for_selector(".jp-OutputArea-output:has-text('after training alone the ranks')",
                                   timeout=480_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            # JupyterLab renders an output after the kernel reported it, so an idle kernel does not
            # mean every image and widget is in the page yet: wait for each element asserted on.
            page.locator(".jp-RenderedImage img").nth(1).wait_for(state="attached", timeout=60_000)
            explorer.locator(".widget-slider").first.wait_for(state="attached", timeout=60_000)
            progress.locator(".widget-hprogress").nth(1).wait_for(state="attached", timeout=60_000)
            expect(progress).to_contain_text("20/20", timeout=60_000)
        finally:
            text = page.locator(".jp-Notebook").inner_text()
            (SHOTS / "welcome_notebook.txt").write_text(text)  # what the page showed, for a failing run
            page.screenshot(path=str(SHOTS / "welcome_end.png"))
        errors = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']")
        tracebacks = [e for e in errors.all_inner_texts() if "Traceback" in e or "Error" in e]
        # The crash demo prints a LaunchError on purpose; any other error is a failure.
        assert not [t for t in tracebacks if "ZeroDivisionError" not in t], tracebacks

        assert "[rank 0] hello from rank 0 of 3" in text
        assert "[rank 2] hello from rank 2 of 3" in text
        assert page.locator(".jp-RenderedImage img").count() >= 2  # the digit grid and the explorer's page
        assert explorer.locator(".widget-slider").count() == 1, "the explorer widget is not rendered"
        assert "VBox(children=" not in text, "widgets fell back to text: the widget manager is missing"
        assert progress.locator(".widget-hprogress").count() == 2, "expected one progress bar per rank"

        # One picture with the explorer at the top and the progress bars below it.
        news = page.locator(".jp-toast-button", has_text="No")
        if news.count():
            news.first.click()  # JupyterLab's "get news?" toast would cover the page's corner
        explorer.evaluate("element => element.scrollIntoView({block: 'start'})")
        page.screenshot(path=str(SHOTS / "welcome_widgets_and_progress.png"))
        browser.close()


CAPSTONE = "17_capstone_your_own_job"


def _half_converted_capstone(path):
    """The capstone's exercise notebook as a learner leaves it halfway: the process group, the
    sampler, the global batch and the writer done; the all-reduce per micro-batch and the
    evaluation not yet (the whole test set on every rank, nothing added up)."""
    import nbformat

    from spike_course.course import conventions, exercises, workers

    solution = course_files.notebook(ROOT / "solutions" / f"{CAPSTONE}.ipynb")
    script = workers.worker_cells(solution)[f"{CAPSTONE}/train.py"]
    for old, new in [("contextlib.nullcontext() if last else ddp_model.no_sync()", "contextlib.nullcontext()"),
                     ("DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256",
                      "DataLoader(test_set, batch_size=256"),
                     ("    dist.all_reduce(totals)\n", "")]:
        assert old in script
        script = script.replace(old, new)
    notebook = exercises.make_exercise(solution)
    cell = next(c for c in notebook.cells if conventions.writes(c) == f"workers/{CAPSTONE}/train.py")
    cell.source = f"%%writefile workers/{CAPSTONE}/train.py\n{script}"
    path.parent.mkdir(parents=True)
    nbformat.write(notebook, path)


def test_a_half_converted_capstone_gets_step_by_step_feedback_in_jupyterlab(tmp_path):
    """A learner's half-done job, run as they would run it: the check cell shows what the ranks
    did and names the first thing that is wrong (the all-reduce per micro-batch), not the
    evaluation that comes later, and not a traceback of the check's own code."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium: apt-get install chromium chromium-driver (CI does)")
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import sync_playwright

    exercise = f"exercises/{CAPSTONE}.ipynb"
    _half_converted_capstone(tmp_path / "course" / exercise)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with running_lab(tmp_path, [], {"SPIKE_COURSE_DATA": "synthetic"}) as (url, token), sync_playwright() as p:
        browser, page = _run_all_cells(p, url, token, exercise)
        feedback = page.locator(".jp-OutputArea-output:has-text('What your ranks did')")
        try:
            feedback.first.wait_for(state="attached", timeout=240_000)
        finally:
            (SHOTS / "capstone_half_converted.txt").write_text(page.locator(".jp-Notebook").inner_text())
        feedback.first.evaluate("element => element.scrollIntoView({block: 'center'})")
        page.screenshot(path=str(SHOTS / "capstone_half_converted.png"))
        said = feedback.first.inner_text()
        browser.close()
    assert "2 times per optimizer step" in said and "(hint 2)" in said, said
    assert "rank 1 (LOCAL_RANK 0), attempt 0" in said and "[2] all-reduce(s) per step" in said, said
    assert "evaluat" not in said.split("What your ranks did")[0], said  # the later mistake waits its turn
    assert "Traceback" not in said and "capstone.py" not in said, said
