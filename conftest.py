"""Root conftest: the course's pytest plugins.

course.labs.pytest_plugin: LAB_IMPL, markers, skip reasons, the results that `python -m course`
reads.
course.labs.feedback: what a run prints (one line per unwritten task, repeats once, the task list),
torch threads, the Hypothesis profiles, pytest's cache outside the repository.
"""

pytest_plugins = ["course.labs.pytest_plugin", "course.labs.feedback"]
