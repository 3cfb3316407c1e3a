"""The scheduler: which requests run in the next step with how many tokens, and what the model
runner is told (``output.SchedulerOutput``). ``reservation`` holds the Orca-style baselines of lab
03-06.

upstream: vllm/v1/core/sched/
"""
