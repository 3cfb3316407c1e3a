"""Root conftest: the course's pytest plugins.

course.labs.pytest_plugin: LAB_IMPL, markers, skip reasons, the results that `python -m course`
reads.
course.labs.feedback: what a run prints (one line per unwritten task, repeats once, the task list),
torch threads, the Hypothesis profiles, pytest's cache outside the repository.
course.labs.assertions: a failed assertion in a lab's tests names the invariant it checks and the
student's functions to look at, above pytest's values.
"""

pytest_plugins = ["course.labs.pytest_plugin", "course.labs.feedback", "course.labs.assertions"]
