"""The course as data: its notebooks read, exercises made from solutions, answers graded,
worker scripts exported, run times recorded, the edition rendered.

These tools read and write the course's files; they start no ranks (``spike_course.lab``)
and judge no answers (``spike_course.checks``).
"""
