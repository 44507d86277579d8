"""The capstone check names each mistake that the job's first attempt shows (the data, the
batch, the gradients, the schedule, the writer and the evaluation: hints 1-4), as soon as the
planned crash ends that attempt: alone, or in groups that stop once the first attempt is judged. The
table is in test_checks_capstone.py, with the rest of the capstone's tests; this half runs in
its own file so that CI's two workers share them."""

import pytest

from test_checks_capstone import (ALONE, FIRST_ATTEMPT_GROUPS, FIRST_ATTEMPT_MISTAKES, planted_alone_is_named,
                                  planted_together_are_each_named)


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in ALONE if name in FIRST_ATTEMPT_MISTAKES])
def test_each_mistake_of_the_first_attempt_is_named(tmp_path, name, no_orphans):
    planted_alone_is_named(tmp_path, name)


@pytest.mark.processes
@pytest.mark.parametrize("group", FIRST_ATTEMPT_GROUPS, ids=[group[0] for group in FIRST_ATTEMPT_GROUPS])
def test_first_attempt_mistakes_planted_together_are_each_named_and_nothing_else(tmp_path, group, no_orphans):
    planted_together_are_each_named(tmp_path, group, first_attempt_only=True)
