"""The student's aids: the dashboard (``python -m course``), the hint ladder (``course hint``)
and predict-then-measure (``course measure``). Imports ``labs``, ``upstream`` and ``engine``."""
