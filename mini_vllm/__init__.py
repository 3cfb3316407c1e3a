"""mini_vllm: a small, faithful rebuild of vLLM's core, written lab by lab in this course."""
