"""The engine core in its own process (``AsyncLLM``'s default): the messages it speaks, the same
tokens as one process, and every way it can fail: killed, hung, failing to start, orphaned, and
killed under a real ``python -m mini_vllm serve`` with streams open."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.engine.core_client import HEARTBEAT_TIMEOUT_S, AsyncMPClient, core_failure
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.engine.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest
from mini_vllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from mini_vllm.metrics.loggers import EngineLoad
from mini_vllm.outputs import EngineCoreOutput
from mini_vllm.request import FinishReason, RequestStatus

MAX_MODEL_LEN = 256
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference():
    return LLM(max_model_len=MAX_MODEL_LEN)


def engine_on(reference, **kwargs) -> AsyncLLM:
    return AsyncLLM(LLM(reference.model, max_model_len=MAX_MODEL_LEN), multiprocessing=True,
                    **kwargs)


async def collect(engine, prompt, params):
    """Every completion's text and ids, merged from the stream's deltas."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    async for out in engine.generate(prompt, params):
        for comp in out.outputs:
            texts[comp.index] = texts.get(comp.index, "") + comp.text
            ids.setdefault(comp.index, []).extend(comp.token_ids)
    return [(texts[i], ids[i]) for i in sorted(texts)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie is gone too


# ---------------------------------------------------------------------------- the messages


def test_messages_round_trip_and_tensors_travel_beside_the_body():
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    out = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [1, 2], FinishReason.STOP, "x", 3),
                 EngineCoreOutput("b", [7])],
        timestamp=12.5, load=EngineLoad(num_running_reqs=2, kv_cache_usage=0.25))
    frames = enc.encode(out)
    assert len(frames) == 1
    back = dec.decode(frames)
    assert back == out and back.outputs[0].finish_reason is FinishReason.STOP
    abort = EngineCoreAbort(["a", "b"], RequestStatus.FINISHED_STOPPED)
    assert MsgpackDecoder(EngineCoreAbort).decode(enc.encode(abort)) == abort
    req = EngineCoreRequest("r-0", [5, 6], SamplingParams(temperature=0.5, seed=3, stop=["x"]),
                            1.0)
    assert MsgpackDecoder(list[EngineCoreRequest]).decode(enc.encode([req])) == [req]
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    frames = enc.encode({"rows": t, "n": 1})
    assert len(frames) == 2 and bytes(frames[1]) == t.view(torch.uint8).numpy().tobytes()
    got = MsgpackDecoder().decode([bytes(f) for f in frames])
    assert torch.equal(got["rows"], t) and got["n"] == 1


def test_a_message_of_the_wrong_type_is_refused_not_run():
    enc = MsgpackEncoder()
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(list[EngineCoreRequest]).decode(enc.encode(EngineCoreAbort(["a"], 5)))
    with pytest.raises(TypeError, match="cannot send a object"):
        enc.encode({"x": object()})


# ---------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def engine(reference):
    engine = engine_on(reference)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("params", [
    dict(temperature=0.0, max_tokens=24),
    dict(temperature=0.8, seed=7, n=2, max_tokens=12),
    dict(temperature=0.0, max_tokens=40, stop=["d"]),
], ids=["greedy", "seeded-n2", "stop-string"])
def test_streams_from_the_core_process_are_the_one_process_tokens(engine, reference, params):
    sp = SamplingParams(**params)
    want = reference.generate("HAMLET.\n", sp, use_tqdm=False)[0].outputs
    got = asyncio.run(collect(engine, "HAMLET.\n", sp))
    assert [text for text, _ in got] == [c.text for c in want]
    if not sp.stop:
        assert [ids for _, ids in got] == [c.token_ids for c in want]


def test_concurrent_streams_and_a_refused_prompt_leave_the_core_serving(engine, reference):
    prompts = ["ROMEO.\n", "JULIET.\n", "KING.\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=16)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, "x" * (MAX_MODEL_LEN + 4), sp)
        got = await asyncio.gather(*(collect(engine, p, sp) for p in prompts))
        await engine.check_health()
        return got

    got = asyncio.run(main())
    want = [reference.generate(p, sp, use_tqdm=False)[0].outputs[0].text for p in prompts]
    assert [g[0][0] for g in got] == want
    assert engine.stat_logger.load.num_running_reqs == 0


def test_metrics_cross_from_the_core_process(reference):
    """The engine's load and counters travel with each step's outputs: ``/metrics`` of a server
    whose (speculating) core runs in its own process counts the requests, the prefix-cache
    hits, the drafts and the accepted tokens, and ends with nothing running and no block held;
    the answers are plain greedy decoding's."""
    from prometheus_client.parser import text_string_to_metric_families

    from course.labs.serving import ServerThread
    from mini_vllm.entrypoints.openai.api_server import build_app

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "draft_policy": "always"}
    engine = AsyncLLM(LLM(reference.model, max_model_len=MAX_MODEL_LEN, speculative_config=spec),
                      model_name="bard", multiprocessing=True)
    server = ServerThread(build_app(engine)).start()
    prompt = "ROMEO.\nBut soft, what light. ROMEO.\nBut soft, what light. ROMEO.\n"
    want = reference.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                     ignore_eos=True), use_tqdm=False)
    try:
        for _ in range(2):
            got = server.client().completions.create(
                model="bard", prompt=prompt, temperature=0.0, max_tokens=24,
                extra_body={"ignore_eos": True})
            assert got.choices[0].text == want[0].outputs[0].text
        deadline = time.monotonic() + 10
        while True:  # the idle snapshot after the last step may trail the last answer
            text = httpx.get(f"{server.base}/metrics", timeout=10).text
            samples = {s.name: s.value for f in text_string_to_metric_families(text)
                       for s in f.samples if "position" not in s.labels}
            if samples["vllm:num_requests_running"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        server.stop()
        engine.shutdown()
    assert samples["vllm:generation_tokens_total"] == 48
    assert samples["vllm:e2e_request_latency_seconds_count"] == 2
    assert samples["vllm:prefix_cache_hits_total"] >= 16 * (len(prompt) // 16), (
        "the second identical prompt found nothing in the prefix cache")
    assert 0 < samples["vllm:spec_decode_num_accepted_tokens_total"] <= samples[
        "vllm:spec_decode_num_draft_tokens_total"]
    assert samples["vllm:spec_decode_num_drafts_total"] > 0
    assert samples["vllm:num_requests_running"] == samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:kv_cache_usage_perc"] == 0


# ---------------------------------------------------------------------------- faults


def test_the_verdict_on_a_core_names_each_way_it_fails():
    beat = EngineCoreOutputs(timestamp=1.0)
    step = EngineCoreOutputs(timestamp=1.0, load=EngineLoad())
    assert core_failure(step, 0.0, None, 60.0) is None
    assert core_failure(beat, 0.0, None, 60.0) is None
    assert core_failure(None, HEARTBEAT_TIMEOUT_S - 0.1, None, 60.0) is None
    # A message answers for the core even when it comes late or the process has just exited:
    # what it says is read first.
    assert core_failure(step, HEARTBEAT_TIMEOUT_S + 1, -9, 60.0) is None
    fatal = EngineCoreOutputs(fatal=True, error="the engine core's loop died: boom")
    assert core_failure(fatal, 0.0, None, 60.0) == "the engine core's loop died: boom"
    long_step = EngineCoreOutputs(step_age=61.5)
    assert "has run for 62 s" in core_failure(long_step, 0.0, None, 60.0)
    assert core_failure(long_step, 0.0, None, None) is None  # no step timeout
    assert core_failure(EngineCoreOutputs(step_age=60.0), 0.0, None, 60.0) is None
    assert "died (killed by signal 9)" in core_failure(None, 0.0, -9, 60.0)
    assert "died (exit code 3)" in core_failure(None, 0.0, 3, 60.0)
    assert "stopped answering" in core_failure(None, HEARTBEAT_TIMEOUT_S + 0.1, None, 60.0)


def test_a_killed_core_fails_every_open_stream_within_a_second(reference):
    engine = engine_on(reference)
    client = engine.core_client
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)
    killed_at: list[float] = []

    async def stream():
        got = 0
        try:
            async for _ in engine.generate("ROMEO.\n", sp):
                got += 1
                if got == 3 and not killed_at:
                    os.kill(client.process.pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
        except EngineDeadError as exc:
            return time.monotonic() - killed_at[0], str(exc)
        return None

    async def main():
        results = await asyncio.wait_for(asyncio.gather(stream(), stream()), 30)
        with pytest.raises(EngineDeadError) as health:
            await engine.check_health()
        return results, str(health.value)

    try:
        results, health = asyncio.run(main())
    finally:
        engine.shutdown()
    for result in results:
        assert result is not None, "a stream ran to its end with its engine core killed"
        waited, why = result
        assert waited < 1.0, f"a stream heard of the dead core after {waited:.2f} s"
        assert "killed by signal 9" in why
    assert "killed by signal 9" in health
    assert gone(client.process.pid) and not Path(client._resources.socket_dir).exists()
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "ROMEO.\n", sp))


# Run in the core process before it builds its engine: every step then sleeps for an hour.
HANG = ("from mini_vllm.engine import core\n"
        "core.EngineCore.step = lambda self: __import__('time').sleep(3600)")


def test_a_hung_step_is_taken_for_dead_and_its_process_killed(reference):
    engine = AsyncLLM(LLM(reference.model, max_model_len=MAX_MODEL_LEN), multiprocessing=False)
    engine.core_client = client = AsyncMPClient(engine.llm, step_timeout_s=1.0,
                                                setup=functools.partial(exec, HANG))
    try:
        with pytest.raises(EngineDeadError, match="one engine step has run for"):
            asyncio.run(asyncio.wait_for(
                collect(engine, "ROMEO.\n", SamplingParams(max_tokens=4)), 30))
    finally:
        engine.shutdown()
    assert gone(client.process.pid) and not Path(client._resources.socket_dir).exists()


def test_a_core_that_fails_to_start_says_why_and_leaves_nothing(reference, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    llm = LLM(reference.model, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(RuntimeError, match="failed to start: RuntimeError: no weights here"):
        AsyncMPClient(llm, setup=functools.partial(exec, "raise RuntimeError('no weights here')"))
    assert list(tmp_path.iterdir()) == []


ORPHAN = textwrap.dedent("""
    import os, signal
    from mini_vllm import LLM
    from mini_vllm.engine.async_llm import AsyncLLM
    engine = AsyncLLM(LLM(max_model_len=64), multiprocessing=True)
    print(engine.core_client.process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_core_exits_when_its_client_process_is_killed(tmp_path):
    run = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == -signal.SIGKILL, run.stderr
    core = int(run.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not gone(core) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(core), "the engine core outlived its client's process"
    assert list(tmp_path.iterdir()) == [], "the core left its socket folder behind"


def test_a_message_the_core_cannot_read_ends_it_loudly(reference):
    """A core whose input thread died would take no request and still say "alive": the input
    it cannot read ends its loop instead, and the client says why."""
    engine = engine_on(reference)
    client = engine.core_client
    try:
        client._input.send_multipart([b"\x07", b"not a request"])
        deadline = time.monotonic() + 10
        while client._dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(EngineDeadError, match="could not read its input"):
            client.check_health()
    finally:
        engine.shutdown()
    assert gone(client.process.pid)


def test_the_multiprocessing_switch_takes_0_or_1(reference, monkeypatch):
    monkeypatch.setenv("MINI_VLLM_ENABLE_MULTIPROCESSING", "false")
    with pytest.raises(ValueError, match="must be 0 .* or 1"):
        AsyncLLM(LLM(reference.model, max_model_len=MAX_MODEL_LEN))
    monkeypatch.setenv("MINI_VLLM_ENABLE_MULTIPROCESSING", "0")
    engine = AsyncLLM(LLM(reference.model, max_model_len=MAX_MODEL_LEN))
    assert not engine.multiprocessing and engine.engine_core is engine.llm.engine


# ---------------------------------------------------------------------------- the real server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned_children(pid: int) -> list[int]:
    """``pid``'s children that multiprocessing spawned (not its resource tracker)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_the_server_on_its_core_process_survives_nothing_silently(reference, tmp_path):
    """``python -m mini_vllm serve``: answers as one process does; with the core killed mid-
    stream every open stream gets an error event within a second and ``/health`` answers 503
    saying why; Ctrl-C then ends the server and nothing is left behind."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mini_vllm", "serve", "--port", str(port),
         "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "bard"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)}, stderr=subprocess.PIPE,
        text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"the server exited: {server.stderr.read()}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            time.sleep(0.2)
        (core,) = spawned_children(server.pid)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        want = reference.generate("HAMLET.\n", SamplingParams(temperature=0.0, max_tokens=20),
                                  use_tqdm=False)[0].outputs[0].text
        got = client.completions.create(model="bard", prompt="HAMLET.\n", temperature=0.0,
                                        max_tokens=20)
        assert got.choices[0].text == want

        streams = [client.completions.create(
            model="bard", prompt=p, temperature=0.0, max_tokens=MAX_MODEL_LEN - 16,
            stream=True, extra_body={"ignore_eos": True}) for p in ("ROMEO.\n", "KING.\n")]
        for s in streams:
            next(iter(s))  # both are running
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:
            with pytest.raises(openai.APIError, match="killed by signal 9"):
                for _ in s:
                    pass
            assert time.monotonic() - killed < 1.0, "a stream heard of the dead core too late"
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503 and "killed by signal 9" in health.text
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            pytest.fail("Ctrl-C did not end the server in 20 s")
        server.stderr.close()
    assert gone(core)
    assert list(tmp_path.iterdir()) == [], "the server left its socket folder behind"
