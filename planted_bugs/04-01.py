"""Known-wrong edits to the engine core's process pieces that lab 04-01's tests must reject: a
tensor that loses its shape or its frame, a decoder that copies what it should wrap (or wraps
what it must copy), an input queue that applies one item a turn or swallows an unreadable one,
a busy loop that spins while idle, forgets a finished request, dies of one bad step or never
sees a stall, and a client that trusts silence over an exit."""

from __future__ import annotations

from course.integrity.bugs import PlantedBug

SERIAL = "mini_vllm/engine/serial_utils.py"
PROC = "mini_vllm/engine/core_proc.py"
CLIENT = "mini_vllm/engine/core_client.py"

BUGS = [
    PlantedBug(
        name="shape-flattened",
        description="the encoder sends a tensor's element count instead of its shape, so every "
        "tensor arrives flat",
        file=SERIAL,
        find='meta = (str(obj.dtype).removeprefix("torch."), list(obj.shape), index)',
        replace='meta = (str(obj.dtype).removeprefix("torch."), [obj.numel()], index)',
    ),
    PlantedBug(
        name="index-from-one",
        description="the encoder numbers frames from 1, so a message's tensors each point at "
        "the next one's bytes",
        file=SERIAL,
        find="index = len(self._buffers)\n",
        replace="index = len(self._buffers) + 1\n",
    ),
    PlantedBug(
        name="whole-storage-sent",
        description="the encoder sends the tensor's whole storage, so a slice carries the "
        "bytes of the tensor it was cut from",
        file=SERIAL,
        find='flat = obj.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)',
        replace='flat = torch.frombuffer(bytearray(obj.detach().to("cpu").untyped_storage()), '
        'dtype=torch.uint8) if obj.is_contiguous() else '
        'obj.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)',
    ),
    PlantedBug(
        name="decoder-always-copies",
        description="the decoder copies every frame, so a received buffer is never the "
        "tensor's memory",
        file=SERIAL,
        find="        if memoryview(raw).readonly:  # bytes",
        replace="        if True:  # bytes",
    ),
    PlantedBug(
        name="read-only-frame-wrapped",
        description="the decoder wraps a bytes frame as it is: the tensor writes through an "
        "immutable object",
        file=SERIAL,
        find="        if memoryview(raw).readonly:  # bytes",
        replace="        if False:  # bytes",
    ),
    PlantedBug(
        name="one-item-a-turn",
        description="the input queue applies one item per call, so a burst of adds and aborts "
        "waits a step per item",
        file=PROC,
        find="""                self._abort(payload)
            try:
                item = self.input_queue.get_nowait()""",
        replace="""                self._abort(payload)
            return True
            try:
                item = self.input_queue.get_nowait()""",
    ),
    PlantedBug(
        name="waits-after-the-first",
        description="after its first item the input queue waits for another one too, so an "
        "idle core's first request waits for the next to arrive",
        file=PROC,
        find="item = self.input_queue.get_nowait()",
        replace="item = self.input_queue.get(block=block)",
    ),
    PlantedBug(
        name="unreadable-input-skipped",
        description="an exception from the input thread is skipped, so a core deaf to its "
        "client goes on as if all were well",
        file=PROC,
        find='raise RuntimeError(f"the engine core could not read its input: {item}")',
        replace="return True",
    ),
    PlantedBug(
        name="never-blocks",
        description="the busy loop never blocks on its input, so an idle core spins and posts "
        "without end",
        file=PROC,
        find="block=not self.engine_core.has_unfinished_requests()",
        replace="block=False",
    ),
    PlantedBug(
        name="no-idle-post",
        description="the loop says nothing when the last request goes away by abort, so the "
        "client's metrics keep its blocks",
        file=PROC,
        find="                self._post(EngineCoreOutputs(timestamp=time.monotonic(), "
        "load=self._snapshot()))\n                continue",
        replace="                continue",
    ),
    PlantedBug(
        name="finished-kept-in-core",
        description="a finished request stays among the core's requests, so a later failed "
        "step reports it failed too",
        file=PROC,
        find="""                if out.finished:
                    self._in_core.pop(out.request_id, None)""",
        replace="""                if out.finished:
                    pass""",
    ),
    PlantedBug(
        name="failed-step-ends-loop",
        description="a step that raises ends the loop instead of failing its requests",
        file=PROC,
        find="except Exception as exc:  # the step failed",
        replace="except ZeroDivisionError as exc:  # the step failed",
    ),
    PlantedBug(
        name="steps-one-at-a-time",
        description="the loop calls step() whatever the engine runs, so async scheduling never "
        "plans a step while another runs",
        file=PROC,
        find="                outputs = core.step_fn()\n",
        replace="                outputs = core.step()\n",
    ),
    PlantedBug(
        name="planning-turn-posted",
        description="a turn that only started a step posts an empty output, a message per "
        "step for nothing",
        file=PROC,
        find="                if outputs is None:\n                    continue",
        replace="                if outputs is None:\n                    outputs = []",
    ),
    PlantedBug(
        name="no-stall-check",
        description="an empty step that changed nothing is never taken for a stall, so the "
        "loop spins on it forever",
        file=PROC,
        find="                    if state == stalled_at:",
        replace="                    if state is None:",
    ),
    PlantedBug(
        name="step-age-kept",
        description="step_started is never cleared, so between steps the heartbeat reports "
        "an ever older step",
        file=PROC,
        find="""            finally:
                self.step_started = None""",
        replace="""            finally:
                pass""",
    ),
    PlantedBug(
        name="silence-before-exit",
        description="the client checks silence before the exit code, so a killed core is "
        "reported as silent rather than dead",
        file=CLIENT,
        find="""    if exitcode is not None:
        return f"the engine core process died ({describe_exit(exitcode)})"
    if silent_s > HEARTBEAT_TIMEOUT_S:""",
        replace="""    if silent_s > HEARTBEAT_TIMEOUT_S:
        return f"the engine core stopped answering for {HEARTBEAT_TIMEOUT_S:.0f} s"
    if exitcode is not None:
        return f"the engine core process died ({describe_exit(exitcode)})"
    if False:""",
    ),
    PlantedBug(
        name="step-timeout-ignored",
        description="the client ignores the step's age, so a hung step holds every stream "
        "forever",
        file=CLIENT,
        find="if step_timeout_s is not None and out.step_age > step_timeout_s:",
        replace="if step_timeout_s is None and out.step_age > 0:",
    ),
]
