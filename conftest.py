"""Root conftest: the course's pytest plugin (LAB_IMPL, markers, Hypothesis profiles, reporting)."""

pytest_plugins = ["course.pytest_plugin"]
