"""Course tooling: lab discovery and loading, grading, and the course's integrity checks."""
