"""Asynchronous scheduling outside the lab: when it is on, what it refuses, and how the engine
composition rebuilds a reference subclass on a student's base class."""

from __future__ import annotations

import pytest

from course.engine.compose import _rebase
from mini_vllm.config import EngineConfig, SchedulerConfig
from mini_vllm.core.sched.async_scheduler import AsyncScheduler
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.engine.core import EngineCore

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}


def test_off_on_a_cpu_unless_asked(tiny_model):
    config = SchedulerConfig(num_gpu_blocks=16, max_model_len=64)
    default = EngineCore(tiny_model, config)
    assert not default.async_scheduling and type(default.scheduler) is Scheduler
    asked = EngineCore(tiny_model, config, async_scheduling=True)
    assert asked.async_scheduling and type(asked.scheduler) is AsyncScheduler


def test_speculation_refuses_it_and_a_bad_value_says_what_it_takes(tiny_model):
    with pytest.raises(ValueError, match="async_scheduling=True does not run with a "
                                         "speculative_config"):
        EngineConfig(async_scheduling=True, speculative_config=NGRAM)
    assert EngineConfig(speculative_config=NGRAM).async_scheduling is None
    with pytest.raises(TypeError, match="async_scheduling must be None, True or False"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(TypeError, match="async_scheduling must be None, True or False"):
        EngineCore(tiny_model, SchedulerConfig(num_gpu_blocks=16), async_scheduling=1)


def test_a_rebuilt_subclass_calls_its_new_base_through_super():
    class Base:
        def name(self):
            return "base"

    class Sub(Base):
        tag = "sub"

        def name(self):
            return "sub+" + super().name()

    class Theirs:
        def name(self):
            return "theirs"

    rebuilt = _rebase(Sub, (Theirs,))
    assert rebuilt().name() == "sub+theirs" and rebuilt.tag == "sub"
    assert issubclass(rebuilt, Theirs) and not issubclass(rebuilt, Base)
    assert Sub().name() == "sub+base"  # the original is untouched
