"""Chapter 15's replica that heals (torchft), killed before, during and after its all-reduce."""

import pytest

from spike_course.course import conventions
from spike_course.lab import replica_drill

import course_files

NOTEBOOK = course_files.ROOT / "notebooks" / "15_training_through_failures.ipynb"
DEATHS = [(2, "before"), (2, "during"), (2, "after")]  # each start of group 1 dies in its 2nd step


@pytest.mark.processes
def test_a_group_killed_before_during_and_after_its_allreduce_heals_each_time(tmp_path, no_orphans):
    script = tmp_path / "replica.py"
    script.write_text(conventions.written_files(course_files.notebook(NOTEBOOK))[
        "workers/15_training_through_failures/replica.py"])
    drill = replica_drill.run(script, tmp_path / "run", deaths=DEATHS)

    assert drill.survivor.result.ok and drill.lives[-1].result.ok, drill.survivor.result.failure
    assert [life.result.returncodes for life in drill.lives[:-1]] == [{0: 1}] * len(DEATHS)  # each died as planned
    done = [step["done"] for step in drill.survivor.steps]
    assert done == sorted(done)  # group 0 never went back: no step it applied was lost
    for life in drill.lives:
        # A new process starts at step 0 with fresh weights: only healing gives it its peer's count.
        first = life.steps[0]
        peer_then = max(s["done"] for s in drill.survivor.steps if s["time"] <= first["time"])
        assert first["done"] >= peer_then > 1, (first, peer_then)
    assert any(step["groups"] == 2 for step in drill.lives[-1].steps)
    assert drill.lives[-1].weights == drill.survivor.weights  # the same model, bit for bit
