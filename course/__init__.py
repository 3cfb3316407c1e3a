"""The course's own tooling: what students, instructors and the course's maintainers run.

A subpackage per job, in layers: a module imports only from its own subpackage and the ones
listed before it (``tests/test_course_layout.py`` holds the list and checks it, with no import
circle anywhere in ``course``); nothing imports ``cli``, and ``mini_vllm`` imports nothing of
the course.

- ``labs``: what a lab is and how its tests run (discovery, loading ``starter.py`` /
  ``solution.py``, tasks, the pytest plugins, numeric comparisons, remembered results);
- ``upstream``: the upstream references and their checks (``course refs``);
- ``figures``: the figures of the notebooks and READMEs (``course figures``);
- ``engine``: the student's own mini_vllm and its exam (``course engine``);
- ``student``: the student's aids: the dashboard, hints, predict-then-measure;
- ``grading``: grading a student or a class (``course grade``);
- ``integrity``: the course's own checks (``course check``): planted bugs, APIs, the exam;
- ``site``: the course site (``python -m course.site``);
- ``cli``: ``python -m course``, on top of all of them.
"""
