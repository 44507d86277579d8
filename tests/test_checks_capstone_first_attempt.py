"""The capstone check names each mistake that the job's first attempt shows (the data, the
batch, the gradients, the schedule, the writer and the evaluation: hints 1-4), as soon as the
planned crash ends that attempt. The table is in test_checks_capstone.py, with the rest of
the capstone's tests; this half runs in its own file so that CI's two workers share them."""

import pytest

from spike_course.checks import CheckFailed, check_capstone_job
from test_checks_capstone import FIRST_ATTEMPT_MISTAKES, plant


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(FIRST_ATTEMPT_MISTAKES))
def test_each_mistake_of_the_first_attempt_is_named(tmp_path, name, no_orphans):
    changes, message = FIRST_ATTEMPT_MISTAKES[name]
    with pytest.raises(CheckFailed, match=message):
        check_capstone_job(plant(tmp_path, *changes), tmp_path)
