"""Code a chapter teaches is defined in that chapter (d2l's rule): no module of
spike_course defines the answer of an exercise, so a learner cannot import it and the
lecture cannot hand it over by accident.

An answer is a top-level function or class of a solution notebook whose body holds a
``### BEGIN SOLUTION`` block. The checks keep what they compare with as references of
their own (e.g. ``federated.fedavg_reference``), named for what they are.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import spike_course
from spike_course.course import conventions

import course_files

ROOT = Path(__file__).resolve().parents[1]


def exercise_answers() -> dict[str, str]:
    """{name: solution notebook} of every function or class a learner writes."""
    answers = {}
    for path in course_files.tracked("solutions", "*.ipynb"):
        for cell in course_files.notebook(path).cells:
            if not conventions.has_solution(cell):
                continue
            source = "\n".join(line for line in cell.source.splitlines() if not line.startswith("%"))
            for node in ast.parse(source).body:
                if (isinstance(node, (ast.FunctionDef, ast.ClassDef))
                        and conventions.BEGIN in ast.get_source_segment(source, node)):
                    answers[node.name] = path.name
    return answers


def package_definitions() -> dict[str, str]:
    """{name: module} of every function and class defined in a module of spike_course."""
    defined = {}
    for info in pkgutil.walk_packages(spike_course.__path__, "spike_course."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) == module.__name__ and callable(value):
                defined[name] = module.__name__
    return defined


def test_the_answers_are_found():
    answers = exercise_answers()
    assert {"my_tree_allreduce", "MySampler", "fedavg_", "find_straggler"} <= set(answers)


def test_no_module_defines_an_exercise_answer():
    defined = package_definitions()
    # "my_tree_allreduce" is answered by a package's "tree_allreduce" just as well
    clashes = {name: (notebook, defined[bare]) for name, notebook in exercise_answers().items()
               for bare in {name, name.removeprefix("my_").removeprefix("My")} if bare in defined}
    assert not clashes, f"the package defines exercise answers (answer: (solution, module)): {clashes}"
