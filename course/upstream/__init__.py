"""Upstream references: the map from the course's symbols to vLLM's source at the pins, and the
checks of ``course refs``. Imports ``labs`` only."""
