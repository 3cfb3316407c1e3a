"""The model runners: ``model_runner`` owns the KV cache tensors and turns a ``SchedulerOutput``
into sampled tokens; ``cpu_decode`` runs a decode step as one compiled call (the CPU's CUDA
graph); ``toy_runner`` is the stand-in without a network that the scheduler labs use.

upstream: vllm/v1/worker/
"""
