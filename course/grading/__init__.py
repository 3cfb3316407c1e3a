"""``python -m course grade``: grading one student or a class against the instructor's copy of
the course. The rest of the course uses this package only through the names below.

``grader`` runs the grading (intake, snapshot, one sandboxed pytest per student and lab, the
exam); ``plugin`` is the pytest plugin of those sessions; ``sandbox`` isolates them; ``reports``
writes the per-student and per-class files; ``similarity`` compares submissions (copydetect's
text fingerprints, and ``structure``'s function-by-function comparison of syntax trees); ``roster``
reads the class roster, splits it into shards and clones the students' repositories
(``course clone``). Imports ``labs`` and ``engine``.
"""

from course.grading.grader import (
    STATUSES,
    GradingError,
    Options,
    class_folders,
    grade,
    merge,
    status_word,
)
from course.grading.roster import (
    RosterError,
    clone_class,
    parse_deadline,
    parse_shard,
    plan,
    read_roster,
    shard_of,
)

__all__ = ["STATUSES", "GradingError", "Options", "RosterError", "class_folders", "clone_class",
           "grade", "merge", "parse_deadline", "parse_shard", "plan", "read_roster", "shard_of",
           "status_word"]
