"""The rendered edition's pieces that need no kernel: titles, chapter figures, the index."""

import base64

import nbformat

from spike_course import edition

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()


def _notebook():
    nb = nbformat.v4.new_notebook()
    first = nbformat.v4.new_code_cell("plot()")
    first.outputs = [nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "fig"})]
    tagged = nbformat.v4.new_code_cell("plot()", metadata={"tags": ["chapter-figure"]})
    tagged.outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(b"tagged").decode()})]
    nb.cells = [nbformat.v4.new_markdown_cell("intro\n# 03 · Data parallel\ntext"), first, tagged]
    return nb


def test_title_is_the_first_heading():
    assert edition.title_of(_notebook(), "x") == "03 · Data parallel"
    assert edition.title_of(nbformat.v4.new_notebook(), "fallback") == "fallback"


def test_the_tagged_figure_stands_for_the_chapter(tmp_path):
    target = edition.save_chapter_figure(_notebook(), tmp_path / "f.png")
    assert target.read_bytes() == b"tagged"
    nb = _notebook()
    nb.cells.pop()  # without a tag: the first image
    assert edition.save_chapter_figure(nb, tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")
    assert edition.save_chapter_figure(nbformat.v4.new_notebook(), tmp_path / "h.png") is None


def test_index_lists_pages_in_order_and_flags_failures(tmp_path):
    pages = [{"title": "00 · Welcome", "href": "notebooks/00.html", "seconds": 12.0, "error": None,
              "folder": "notebooks", "figure": "figures/notebooks/00.png"},
             {"title": "01 · Messages", "href": "notebooks/01.html", "seconds": 3.0,
              "error": "CellExecutionError: boom", "folder": "notebooks", "figure": None}]
    text = edition.write_index(pages, tmp_path).read_text()
    assert text.index("00 · Welcome") < text.index("01 · Messages")
    assert "12 s" in text and "failed: CellExecutionError: boom" in text
    assert '<img src="figures/notebooks/00.png"' in text
