"""The lab model: what a lab is and how its tests run. The bottom layer; imports no other part
of the course.

``catalog`` finds labs and their metadata (``labs.toml``); ``loader`` loads a lab's
``starter.py`` or ``solution.py`` as ``LAB_IMPL`` says; ``tasks`` reads a starter's open tasks;
``numerics`` compares tensors for tests; ``pytest_plugin`` and ``feedback`` are the pytest
plugins of every run; ``runner`` runs a lab's tests in a subprocess; ``results`` remembers each
lab's result under a key of everything it depends on, and ``published`` knows the published
starters (an untouched lab runs nothing); ``console`` prints tables and progress.
"""
