"""The student's own engine: mini_vllm with the student's finished pieces in place of the
reference's (``compose``), the engine exam (``exam``), the worker process that runs both
(``worker``) and ``python -m course engine`` (``command``). Imports ``labs`` only."""
