"""The capstone check names each mistake that the job's first attempt shows (the data, the
batch, the gradients, the schedule, the writer and the evaluation: hints 1-4), as soon as the
planned crash ends that attempt: those planted alone (the others are planted in groups). The
table is in test_checks_capstone.py, with the rest of the capstone's tests; this half runs in
its own file so that CI's two workers share them."""

import pytest

from test_checks_capstone import ALONE, FIRST_ATTEMPT_MISTAKES, planted_alone_is_named


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in ALONE if name in FIRST_ATTEMPT_MISTAKES])
def test_each_mistake_of_the_first_attempt_is_named(tmp_path, name, no_orphans):
    planted_alone_is_named(tmp_path, name)
