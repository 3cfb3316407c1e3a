"""``python -m course check``: the course's own integrity. Solutions pass, starters fail,
APIs match (``api``), planted bugs are rejected (``bugs``, ``checks``), starters whose tasks do
nothing earn nothing (``null_starters``, ``null_check``), the engine exam holds
against stand-in students (``shadow``, ``exam_check``), and the grading path survives a class
of cheating submissions. Imports every layer below it, ``grading`` included."""
