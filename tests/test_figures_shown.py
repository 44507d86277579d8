"""A chapter shows its figures although the kernel's environment says MPLBACKEND=Agg, as a
cluster shell often does, and says which variable it overrode."""

import os
from unittest import mock

import nbformat
import pytest

from spike_course.lab.headless import run_notebook

pytestmark = pytest.mark.processes  # starts a kernel

CELLS = ["from spike_course import notebook\nnotebook.setup('99_probe')",
         "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()"]


@pytest.mark.parametrize("backend", ["Agg", None])
def test_a_chapter_shows_its_figure_whatever_mplbackend_says(tmp_path, backend):
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS]), path)
    environment = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    if backend:
        environment["MPLBACKEND"] = backend
    with mock.patch.dict(os.environ, environment, clear=True):
        run = run_notebook(path, timeout=120)
    assert run.error is None, run.error
    setup_output, figure_output = (c.outputs for c in run.notebook.cells)
    assert any("image/png" in o.get("data", {}) for o in figure_output)
    said = "".join(o.get("text", "") for o in setup_output)
    assert ("MPLBACKEND=Agg in this kernel's environment would hide every figure" in said) == bool(backend)
