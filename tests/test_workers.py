"""spike-course workers exports a learner's own notebooks too, with a README for the node."""

from pathlib import Path

import nbformat

from spike_course import exercises
from spike_course.cli import main

import course_files

ROOT = Path(__file__).resolve().parents[1]
CAPSTONE = "15_capstone_your_own_job"


def test_a_learners_answers_are_exported_and_blanks_are_named(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "my_exercises"
    mine.mkdir()
    course_files.copy_to(ROOT / "exercises" / "02_distributed_sampling.ipynb", mine)  # not answered yet
    course_files.copy_to(ROOT / "solutions" / f"{CAPSTONE}.ipynb", mine)  # answered (as the solution)
    monkeypatch.chdir(ROOT)
    assert main(["workers", "--from", str(mine), "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    train = (tmp_path / "out" / CAPSTONE / "train.py").read_text()
    assert "DistributedSampler(train_set" in train and "BEGIN SOLUTION" not in train
    assert "still the exercise's blank" not in said
    readme = (tmp_path / "out" / "README.md").read_text()
    assert f"    torchrun --standalone --nproc-per-node=2 {CAPSTONE}/train.py" in readme
    assert "--nproc-per-node=8" in readme and not (tmp_path / "out" / "03_data_parallel").exists()


def test_an_exercise_left_blank_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    blank = tmp_path / f"{CAPSTONE}.ipynb"
    nbformat.write(exercises.make_exercise(course_files.notebook(ROOT / "solutions" / blank.name)), blank)
    assert main(["workers", "--from", str(blank), "--out", str(tmp_path / "out")]) == 0
    assert f"still the exercise's blank (they raise NotImplementedError): {CAPSTONE}/train.py" in capsys.readouterr().out


def test_a_missing_source_is_named(tmp_path, capsys):
    assert main(["workers", "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert "--from" in capsys.readouterr().err
