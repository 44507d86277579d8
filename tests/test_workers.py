"""spike-course workers exports a learner's own notebooks too, with a README for the node."""

from pathlib import Path

import nbformat

from spike_course.course import exercises
from spike_course.cli import main

import course_files

ROOT = Path(__file__).resolve().parents[1]
CAPSTONE = "17_capstone_your_own_job"


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


def exported(tmp_path):
    from spike_course.course import workers

    written = workers.export(ROOT, tmp_path)
    return {p.relative_to(tmp_path).as_posix(): p.read_text() for p in written}, (tmp_path / "README.md").read_text()


def test_the_readme_gives_each_worker_its_own_run_line_and_marks_the_failures(tmp_path):
    from spike_course.course import workers

    sources, readme = exported(tmp_path)
    runs = [line.strip() for line in readme.splitlines() if line.startswith("    torchrun ")]
    assert len({line.split()[2] for line in runs}) > 2  # processes as each worker needs, not one count for all
    failing = sorted(name for name, source in sources.items() if workers.fails_on_purpose(source))
    assert {"00_welcome_and_setup/crash.py", "01_message_passing/deadlock.py",
            "10_profiling_and_debugging/hung_job.py"} <= set(failing)
    for name, source in sources.items():
        first = source.split("\n", 1)[0][3:]
        if workers.MODULE in first:
            continue
        marked = f"    {first}    # fails on purpose"
        assert (marked in readme) == (name in failing), name
        if name in failing:
            assert f"- `{name}`: {workers.fails_on_purpose(source)}" in readme


def test_every_input_file_a_run_line_names_is_explained(tmp_path):
    import re

    _, readme = exported(tmp_path)
    runs, explained = readme.split("## Input files")
    named = set(re.findall(r"(--[\w-]+ (?:[A-Z]+\.pt|\.\.\.))", runs))
    assert named == {"--batch-file BATCH.pt", "--data-file DIGITS.pt", "--data ..."}
    assert all(f"`{option}`" in explained for option in named)


def test_the_readmes_recipe_writes_the_files_chapter_04_writes(tmp_path, monkeypatch):
    import re
    import textwrap

    import torch

    from spike_course.data import load_mnist

    _, readme = exported(tmp_path / "out")
    recipe = textwrap.dedent(re.search(r"python - <<'EOF'\n(.*?)\n    EOF", readme, re.S).group(1))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPIKE_COURSE_DATA", "synthetic")
    (tmp_path / "04_pipeline_parallel").mkdir()
    exec(recipe, {})
    images, labels = torch.load(tmp_path / "04_pipeline_parallel" / "batch.pt")
    digits = load_mnist(limit=64)  # the lecture's batch.pt
    assert torch.equal(images, torch.stack([digits[i][0] for i in range(64)]))
    assert labels.tolist() == [digits[i][1] for i in range(64)]
    train_x, train_y, test_x, test_y = torch.load(tmp_path / "04_pipeline_parallel" / "digits.pt")
    assert (len(train_x), len(train_y), len(test_x), len(test_y)) == (128, 128, 64, 64)  # the solution's sizes
