"""The run times the README states are those the builds measured (spike_course.course.run_times):
each between <!-- run-times: KEY --> markers, written from notebooks/run_times.json."""

import json

from spike_course.course import run_times

import course_files

ROOT = course_files.ROOT


def test_the_readme_states_the_measured_run_times():
    data = run_times.load(ROOT / run_times.FILE)
    problems = run_times.disagreements((ROOT / "README.md").read_text(), data)
    assert not problems, "\n".join(problems) + "\n(`spike-course run-times` writes them; `make run-times` measures)"


def test_every_lecture_has_a_measured_time_and_the_readme_shows_it():
    data = run_times.load(ROOT / run_times.FILE)
    keys = {m.group("key") for m in run_times.FIGURE.finditer((ROOT / "README.md").read_text())}
    for lecture in course_files.tracked("notebooks", "[0-9][0-9]_*.ipynb"):
        assert lecture.stem in data["lectures"], f"{lecture.stem} was never measured: make run-times"
        assert lecture.stem in keys, f"the README's chapter table has no run-times marker for {lecture.stem}"
    for entry in data["lectures"].values():
        assert entry["seconds"] > 0 and "core" in entry["machine"] and entry["day"]


def test_a_figure_typed_by_hand_is_named_and_rewritten(tmp_path):
    data = {"lectures": {"00_a": {"seconds": 34.2, "machine": "2 cores of X", "day": "2026-12-06"},
                         "01_b": {"seconds": 7.9, "machine": "2 cores of X", "day": "2026-12-06"}},
            "builds": {"make html": {"seconds": 570, "machine": "2 cores of X", "day": "2026-12-06"}}}
    readme = ("| `00_a` | <!-- run-times: 00_a -->25 s<!-- /run-times --> |\n"
              "it took <!-- run-times: make html -->a few minutes<!-- /run-times -->, lectures "
              "<!-- run-times: lecture range -->8 s to 34 s<!-- /run-times --> on "
              "<!-- run-times: lectures measured -->2 cores of X, 2026-12-06<!-- /run-times -->; "
              "pytest <!-- run-times: pytest -->not measured yet<!-- /run-times -->; "
              "<!-- run-times: 02_c -->9 s<!-- /run-times -->")
    assert run_times.disagreements(readme, data) == [
        "00_a: README says '25 s', the measurement '34 s'",
        "make html: README says 'a few minutes', the measurement '9.5 minutes (2 cores of X, 2026-12-06)'",
        "02_c: measured by nothing yet"]
    fixed, unknown = run_times.rewrite(readme, data)
    assert unknown == ["02_c"] and run_times.disagreements(fixed, data) == ["02_c: measured by nothing yet"]
    assert "<!-- run-times: 00_a -->34 s<!-- /run-times -->" in fixed


def test_recording_stamps_each_figure_with_the_machine_and_keeps_the_others(tmp_path):
    path = tmp_path / "run_times.json"
    run_times.record(path, {"00_a": 30.04, "01_b": 12.0}, {"make html": 570.4})
    run_times.record(path, {"01_b": 13.0}, {"pytest": 400.0}, workers=2)
    data = json.loads(path.read_text())
    assert [(k, v["seconds"]) for k, v in data["lectures"].items()] == [("00_a", 30.0), ("01_b", 13.0)]
    assert data["builds"]["pytest"]["workers"] == 2 and data["builds"]["make html"]["seconds"] == 570
    assert data["lectures"]["00_a"]["machine"] == run_times.machine()
    assert run_times.machine().split(" ", 1)[1].startswith(("cores of", "core of"))
