"""Speculative decoding: proposers that guess a request's next tokens cheaply, so that the target
model can check several of them in one step (the check is ``sample/rejection_sampler.py``).
The n-gram (prompt-lookup) proposer and the draft-model proposer.

upstream: vllm/v1/spec_decode/
"""
