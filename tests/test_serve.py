"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP.

One uvicorn server per module (on 127.0.0.1, a free port, in a thread of this process, so the
tests can read the engine's block pool directly), serving the shipped tiny model. The reference
is ``LLM.generate`` on the same weights: every answer, streamed or whole, must equal it token for
token (``return_token_ids``). Bad requests must get the OpenAI error shape with a 4xx and leave
the engine as it was; a client that goes away mid-request must leave no KV block behind.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from course.labs.serving import ServerThread, wait_idle
from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import build_app
from mini_vllm.entrypoints.openai.protocol import ChatCompletionRequest
from mini_vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from mini_vllm.sampling_params import SamplingParams

MODEL = "tiny-shakespeare"
# A chat template for the Shakespeare model: each message as a speaker's line, then the cue.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}.\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}HAMLET.\n{% endif %}"
)
MAX_MODEL_LEN = 256


class Served(ServerThread):
    """The running server (``course/labs/serving.py``), its engine, and a reference LLM on the
    same weights."""

    def __init__(self) -> None:
        self.reference = LLM(max_model_len=MAX_MODEL_LEN)
        # In one process: the tests read the engine core's state (its own process is tested in
        # tests/engine/test_core_process.py).
        self.engine = AsyncLLM(LLM(self.reference.model, max_model_len=MAX_MODEL_LEN),
                               model_name=MODEL, multiprocessing=False)
        super().__init__(build_app(self.engine, chat_template=TEMPLATE))

    @property
    def pool(self):
        return self.engine.engine_core.scheduler.kv_cache_manager.block_pool

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Wait until the engine holds no request and no block; fail with what is still held."""
        if (held := wait_idle(self.engine, timeout)) is not None:
            pytest.fail(held)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels other than model_name folded in)."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                extra = {k: v for k, v in sample.labels.items() if k != "model_name"}
                key = sample.name + "".join(f"[{k}={v}]" for k, v in sorted(extra.items()))
                out[key] = sample.value
        return out


@pytest.fixture(scope="module")
def served():
    s = Served().start()
    yield s
    s.stop()


def expected(served: Served, prompt: str, **params) -> list:
    return served.reference.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs


def _steps(served: Served) -> int:
    """Engine steps so far: a request that runs to its end takes one step per token."""
    return served.engine.engine_core.scheduler.stats.num_steps


def stream_choices(chunks) -> dict[int, dict]:
    """Per choice index: concatenated text, token ids, finish reason, and the pieces."""
    got: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            c = got.setdefault(choice.index, {"text": "", "ids": [], "finish": None,
                                              "pieces": []})
            piece = getattr(choice, "text", None)
            if piece is None:  # a chat chunk
                piece = choice.delta.content or ""
            c["text"] += piece
            c["pieces"].append(piece)
            c["ids"] += getattr(choice, "token_ids", None) or []
            c["finish"] = choice.finish_reason or c["finish"]
    return got


# ---------------------------------------------------------------------------- the happy paths


def test_models_health_and_an_idle_engine(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{served.base}/health", timeout=10).status_code == 200
    assert served.pool.get_num_free_blocks() == served.pool.num_gpu_blocks - 1


PROMPTS = [
    # (prompt, extra sampling parameters)
    ("ROMEO.\n", {"max_tokens": 24}),
    ("KING.\nWhat say you", {"max_tokens": 48, "stop": ["the", "\n\n"]}),
    ("ROMEO.\n", {"max_tokens": 48, "stop": ["the"], "include_stop_str_in_output": True}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompt,extra", PROMPTS, ids=["plain", "stop", "stop-kept"])
def test_completion_equals_generate_token_for_token(served, prompt, extra, stream):
    want = expected(served, prompt, temperature=0.0, **extra)[0]
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0.0, stream=stream,
                  extra_body={"return_token_ids": True,
                              **{k: v for k, v in extra.items() if k != "max_tokens" and
                                 k != "stop"}},
                  max_tokens=extra["max_tokens"], stop=extra.get("stop"))
    steps_before = _steps(served)
    response = served.client().completions.create(**kwargs)
    if stream:
        got = stream_choices(response)[0]
        text, ids, finish = got["text"], got["ids"], got["finish"]
    else:
        choice = response.choices[0]
        text, ids, finish = choice.text, choice.token_ids, choice.finish_reason
        assert response.usage.completion_tokens == len(want.token_ids)
    assert ids == want.token_ids, "the server generated other tokens than LLM.generate"
    assert text == want.text
    assert finish == want.finish_reason
    served.wait_idle()
    # One step per token. A stop string is found on the event loop, so the core thread may run
    # a step or two more before its abort arrives, but never on to max_tokens.
    steps = _steps(served) - steps_before
    if isinstance(want.stop_reason, str):
        assert len(want.token_ids) <= steps < extra["max_tokens"], (
            f"the engine ran {steps} steps for a request a stop string ended after "
            f"{len(want.token_ids)} tokens: the stop must abort the request in the engine too")
    else:
        assert steps == len(want.token_ids)


def test_streaming_sends_tokens_as_they_are_made(served, monkeypatch):
    """A stream is not the whole answer sent at the end: a token reaches the client while the
    engine has the next ones still to make, and the concatenation is LLM.generate's text.

    The engine waits before each step after the first until the client has read one more text
    piece (at most a second), so how many pieces arrive does not depend on how busy the machine
    is: a server that held the stream back would let every wait run out and send a few."""
    want = expected(served, "HAMLET.\n", temperature=0.0, max_tokens=32)[0]
    core = served.engine.engine_core
    read, step, steps = threading.Semaphore(0), core.step, []

    def step_once_the_client_has_read():
        if steps:
            read.acquire(timeout=1.0)
        steps.append(1)
        return step()

    monkeypatch.setattr(core, "step", step_once_the_client_has_read)
    chunks = []
    for chunk in served.client().completions.create(
            model=MODEL, prompt="HAMLET.\n", temperature=0.0, max_tokens=32, stream=True):
        chunks.append(chunk)
        if any(choice.text for choice in chunk.choices):
            read.release()
    got = stream_choices(chunks)[0]
    assert got["text"] == want.text
    assert len([p for p in got["pieces"] if p]) >= 8, (
        f"32 tokens came in {len(chunks)} chunk(s): the server buffered the stream")


def test_chat_applies_the_template_streamed_and_whole(served):
    messages = [{"role": "user", "content": "Who is there?"}]
    want = served.reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=16),
                                 chat_template=TEMPLATE, use_tqdm=False)[0]
    client = served.client()
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0,
                                           max_tokens=16,
                                           extra_body={"return_token_ids": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.prompt_token_ids == want.prompt_token_ids, "the template was not applied"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 temperature=0.0, max_tokens=16, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_choices(chunks)[0]["text"] == want.text
    served.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_samples_equal_generate(served, stream):
    params = dict(temperature=0.9, seed=7, max_tokens=12, n=3)
    want = expected(served, "QUEEN.\n", **params)
    assert len({w.text for w in want}) > 1, "pick a seed whose samples differ"
    response = served.client().completions.create(
        model=MODEL, prompt="QUEEN.\n", stream=stream, extra_body={"return_token_ids": True},
        **params)
    if stream:
        got = stream_choices(response)
        texts = [got[i]["text"] for i in range(3)]
        ids = [got[i]["ids"] for i in range(3)]
    else:
        texts = [c.text for c in response.choices]
        ids = [c.token_ids for c in response.choices]
    assert ids == [w.token_ids for w in want]
    assert texts == [w.text for w in want]
    served.wait_idle()


def test_concurrent_clients_get_their_own_answers(served):
    prompts = ["ROMEO.\n", "JULIET.\n", "KING.\n"]
    want = {p: expected(served, p, temperature=0.0, max_tokens=16)[0].text for p in prompts}
    got: dict[str, str] = {}

    def ask(prompt: str) -> None:
        chunks = served.client().completions.create(model=MODEL, prompt=prompt,
                                                    temperature=0.0, max_tokens=16, stream=True)
        got[prompt] = stream_choices(chunks)[0]["text"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == want
    served.wait_idle()


# ---------------------------------------------------------------------------- refusals


BAD = [
    # (endpoint kwargs, status, fragment of the message)
    ({"model": "gpt-4", "prompt": "x"}, 404, "gpt-4"),
    ({"model": MODEL, "prompt": "x" * (MAX_MODEL_LEN + 5)}, 400, "max_model_len"),
    ({"model": MODEL, "prompt": "x", "temperature": -1.0}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n must be"),
    ({"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "extra_body": {"max_tokens": "many"}}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "extra_body": {"temprature": 0.5}}, 400, "temprature"),
    ({"model": MODEL, "prompt": [[1, 2], [3]]}, 400, "one prompt per request"),
    ({"model": MODEL, "prompt": [300]}, 400, "vocab"),
]


BAD_IDS = ["unknown-model", "prompt-too-long", "temperature", "top_p", "max_tokens", "n",
           "logprobs", "wrong-type", "unknown-field", "several-prompts", "token-outside-vocab"]
# A streamed request is refused the same way, before its stream starts (one case per layer: the
# model check, the engine's length check, the sampling parameters).
CASES = [pytest.param(*case, False, id=f"{name}-whole") for case, name in zip(BAD, BAD_IDS)] + [
    pytest.param(*case, True, id=f"{name}-streamed") for case, name in zip(BAD, BAD_IDS)
    if name in ("unknown-model", "prompt-too-long", "temperature")]


@pytest.mark.parametrize("kwargs,status,fragment,stream", CASES)
def test_bad_request_gets_openai_error_and_changes_nothing(served, kwargs, status, fragment,
                                                           stream):
    client = served.client()
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(stream=stream, **kwargs)
    err = caught.value
    assert err.status_code == status
    body = err.body
    assert set(body) >= {"message", "type", "param", "code"}, body
    assert body["code"] == status
    assert fragment in body["message"], body["message"]
    served.wait_idle()
    # The engine still serves.
    ok = client.completions.create(model=MODEL, prompt="ROMEO.\n", temperature=0.0,
                                   max_tokens=3)
    assert ok.choices[0].text == _romeo_3(served)


def _romeo_3(served: Served, cache: dict = {}) -> str:  # noqa: B006 - a deliberate memo
    if "text" not in cache:
        cache["text"] = expected(served, "ROMEO.\n", temperature=0.0, max_tokens=3)[0].text
    return cache["text"]


def test_chat_refuses_non_text_content_and_a_model_without_template(served):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().chat.completions.create(
            model=MODEL, temperature=0.0, max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": "x"}}]}])
    assert "text only" in caught.value.body["message"]
    # The shipped model has no template of its own: a server started without one says so.
    bare = OpenAIServingChat(served.engine, MODEL, chat_template=None)
    request = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        bare.render_prompt(request)
    served.wait_idle()


def test_unknown_route_and_malformed_json_use_the_error_shape(served):
    r = httpx.get(f"{served.base}/v1/nothing", timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) >= {"message", "type", "code"}
    r = httpx.post(f"{served.base}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def _prompt_tokens(served: Served, endpoint: str) -> int:
    """How many tokens the server counts in the prompt of ``_ask(endpoint, ...)``."""
    return _ask(served, endpoint, max_tokens=1).usage.prompt_tokens


def _ask(served: Served, endpoint: str, **kwargs):
    client = served.client()
    if endpoint == "completions":
        return client.completions.create(model=MODEL, prompt="ROMEO.\n", temperature=0.0,
                                         **kwargs)
    return client.chat.completions.create(model=MODEL, temperature=0.0,
                                          messages=[{"role": "user", "content": "Who?"}],
                                          **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint,field,extra", [
    ("completions", "max_tokens", 1), ("completions", "max_tokens", 10**9),
    ("chat", "max_tokens", 10**9), ("chat", "max_completion_tokens", 1)])
def test_max_tokens_beyond_the_context_is_a_400_that_says_how_many_fit(served, endpoint, field,
                                                                       extra, stream):
    """Prompt plus max_tokens above max_model_len is refused (as OpenAI and vLLM do), never
    clipped into a shorter answer than asked for; the message names the largest that fits."""
    prompt_len = _prompt_tokens(served, endpoint)
    room = MAX_MODEL_LEN - prompt_len
    asked = room + extra
    served.wait_idle()
    steps_before = _steps(served)
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(served, endpoint, stream=stream, **{field: asked})
    body = caught.value.body
    assert {k: body[k] for k in ("type", "param", "code")} == {
        "type": "BadRequestError", "param": field, "code": 400}, body
    for fragment in (f"{field}={asked}", f"prompt's {prompt_len} tokens",
                     f"context of {MAX_MODEL_LEN}", f"at most {room}"):
        assert fragment in body["message"], (fragment, body["message"])
    served.wait_idle()
    assert _steps(served) == steps_before, "a refused request ran in the engine"
    # The largest that fits is accepted (checked without generating it all).
    serving = OpenAIServingChat(served.engine, MODEL)
    assert serving.output_budget(room, prompt_len, field) == room
    assert serving.output_budget(None, prompt_len) == room


def _raw_stream(served: Served, path: str, body: dict) -> list[dict]:
    """The JSON of every event of a streamed response, read as raw SSE (the ``openai`` client
    hides whether a field is null or absent), after checking that ``[DONE]`` ends it."""
    with served.http_client() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]", events[-1:]
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ROMEO.\n"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who?"}]})],
    ids=["completions", "chat"])
def test_include_usage_puts_usage_null_on_every_chunk_but_the_last(served, path, body):
    body = {"model": MODEL, "temperature": 0.0, "max_tokens": 6, "stream": True, **body}
    chunks = _raw_stream(served, path, {**body, "stream_options": {"include_usage": True}})
    *ordinary, last = chunks
    assert ordinary and last["choices"] == [] and last["usage"]["completion_tokens"] == 6, last
    assert [c for c in ordinary if "usage" not in c or c["usage"] is not None] == [], (
        "with include_usage every chunk but the last carries \"usage\": null (OpenAI does)")
    plain = _raw_stream(served, path, body)
    assert plain and all("usage" not in c for c in plain), plain
    served.wait_idle()


# ---------------------------------------------------------------------------- going away



def test_client_closing_a_stream_frees_every_block(served):
    """Read a few chunks of a long answer, hang up: the request is aborted (it stops long before
    its max_tokens) and every block it held is free again."""
    longest = MAX_MODEL_LEN - 8
    before = _steps(served)
    with served.client().completions.create(
            model=MODEL, prompt="ROMEO.\n", temperature=0.0, max_tokens=longest, stream=True,
            extra_body={"ignore_eos": True}) as stream:
        for i, _chunk in enumerate(stream):
            if i == 5:
                held = served.engine.engine_core.num_blocks_in_use
                break
    assert held > 0, "the request held no block while it ran"
    served.wait_idle()
    assert served.pool.get_num_free_blocks() == served.pool.num_gpu_blocks - 1
    steps = _steps(served) - before
    assert steps < longest, (
        f"the request ran to its end ({steps} steps) after the client hung up: a disconnect "
        "must abort it")


def test_client_timing_out_on_a_whole_response_frees_every_block(served, monkeypatch):
    longest = MAX_MODEL_LEN - 8
    # Each step made to last 5 ms: the whole response takes over a second whatever the machine
    # (the tiny model's own steps can be fast enough to beat the timeout).
    runner = served.engine.engine_core.model_runner
    real = runner.execute_model

    def slow_step(*args, **kwargs):
        time.sleep(0.005)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", slow_step)
    before = _steps(served)
    with pytest.raises(openai.APITimeoutError):
        served.client(timeout=0.3).completions.create(
            model=MODEL, prompt="JULIET.\n", temperature=0.0, max_tokens=longest,
            extra_body={"ignore_eos": True})
    served.wait_idle()
    monkeypatch.undo()
    assert served.pool.get_num_free_blocks() == served.pool.num_gpu_blocks - 1
    assert _steps(served) - before < longest, "the request ran to its end after the timeout"


def _serves_again(served, monkeypatch) -> None:
    """With the fault undone, the next request completes normally."""
    monkeypatch.undo()
    served.wait_idle()
    ok = served.client().completions.create(model=MODEL, prompt="ROMEO.\n", temperature=0.0,
                                            max_tokens=5)
    assert ok.choices[0].finish_reason == "length"


def test_engine_failure_mid_stream_is_reported_and_the_engine_recovers(served, monkeypatch):
    runner = served.engine.engine_core.model_runner
    real, calls = runner.execute_model, []

    def fail_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated device fault")
        # 5 ms a step: the stream has started (its first output sent) when the third one fails.
        time.sleep(0.005)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", fail_on_third)
    with pytest.raises(openai.APIError) as caught:
        for _ in served.client().completions.create(model=MODEL, prompt="ROMEO.\n",
                                                    temperature=0.0, max_tokens=20,
                                                    stream=True):
            pass
    assert "simulated device fault" in str(caught.value)
    _serves_again(served, monkeypatch)
    assert httpx.get(f"{served.base}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_before_the_first_output_is_a_500_that_names_it(served, monkeypatch,
                                                                        stream):
    runner = served.engine.engine_core.model_runner

    def fail(*args, **kwargs):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(runner, "execute_model", fail)
    with pytest.raises(openai.InternalServerError) as caught:
        response = served.client().completions.create(
            model=MODEL, prompt="ROMEO.\n", temperature=0.0, max_tokens=5, stream=stream)
        for _ in response if stream else ():
            pass
    assert caught.value.status_code == 500
    assert "the engine failed while generating" in str(caught.value)
    assert "simulated device fault" in str(caught.value)
    _serves_again(served, monkeypatch)


# ---------------------------------------------------------------------------- metrics


def test_metrics_count_requests_latencies_and_prefix_hits(served):
    before = served.metrics()
    prompt = "FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n"  # > 2 blocks
    client = served.client()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=6,
                                  extra_body={"ignore_eos": True})
    served.wait_idle()
    after = served.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 2 * 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_success_total[finished_reason=length]") == 2
    assert delta("vllm:generation_tokens_total") == 12
    full_blocks = len(prompt) // 16
    assert delta("vllm:prefix_cache_hits_total") >= 16 * full_blocks, (
        "the second identical prompt found nothing in the prefix cache")
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert 0 < after["mini_vllm:prefix_cache_hit_rate"] <= 1


# ---------------------------------------------------------------------------- the command


def test_python_m_mini_vllm_serve_builds_and_runs_the_server(tmp_path, monkeypatch):
    """``python -m mini_vllm serve`` with its options reaches uvicorn with the engine it asked
    for (uvicorn's run is replaced: the tests above run the real one)."""
    import uvicorn

    from mini_vllm.__main__ import main

    ran = {}
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda self, *a, **k: ran.update(config=self.config))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    assert main(["serve", "--port", "8123", "--served-model-name", "bard", "--max-model-len",
                 "128", "--chat-template", str(template), "--log-level", "warning"]) == 0
    config = ran["config"]
    assert (config.host, config.port) == ("127.0.0.1", 8123)
    engine = config.app.state.engine
    assert engine.model_name == "bard" and engine.max_model_len == 128
    routes = {r.path for r in config.app.routes}
    assert routes >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                      "/metrics"}
    engine.shutdown()


def test_a_leak_names_the_structure_that_holds_the_request():
    """The message names what still holds a request, not counts of what is empty (a leak left
    in the output processor once read "holds 0 request(s) and 0 KV block(s)")."""
    from types import SimpleNamespace

    engine = SimpleNamespace(
        multiprocessing=False,  # its engine core in this process, read directly
        engine_core=SimpleNamespace(scheduler=SimpleNamespace(requests={}), num_blocks_in_use=0),
        output_processor=SimpleNamespace(request_states={"req-3": object()}))
    message = wait_idle(engine, timeout=0)
    assert message.startswith("the engine still holds 1 request(s) in "
                              "output_processor.request_states ('req-3')"), message
    assert "scheduler" not in message and "KV block" not in message, message


def test_a_core_in_its_own_process_is_read_from_the_load_it_reported():
    """With the engine core in another process there is no scheduler to read: what it holds is
    the load it last reported (after each step, and once more when it goes idle)."""
    from types import SimpleNamespace

    from mini_vllm.metrics.loggers import EngineLoad

    load = EngineLoad(num_running_reqs=1, num_kv_blocks_in_use=2)
    engine = SimpleNamespace(multiprocessing=True, stat_logger=SimpleNamespace(load=load),
                             output_processor=SimpleNamespace(request_states={}))
    message = wait_idle(engine, timeout=0)
    assert message.startswith("the engine still holds 1 request(s) in the engine core's "
                              "scheduler; 2 KV block(s) in use"), message
    engine.stat_logger.load = EngineLoad()
    assert wait_idle(engine, timeout=0) is None


# ---------------------------------------------------------------------------- speculation


def test_a_speculating_server_answers_as_plain_greedy_and_exports_its_acceptance(served):
    """``speculative_config`` on the served engine: streamed and whole answers are the plain
    engine's tokens, a step may bring several of them to the stream, and ``/metrics`` carries
    upstream's spec_decode counters (drafts, draft tokens, accepted, accepted per position)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "draft_policy": "always"}
    engine = AsyncLLM(LLM(served.reference.model, max_model_len=MAX_MODEL_LEN,
                          speculative_config=spec), model_name=MODEL, multiprocessing=False)
    server = ServerThread(build_app(engine)).start()
    try:
        prompt = "ROMEO.\nBut soft, what light. ROMEO.\nBut soft, what light. ROMEO.\n"
        want = expected(served, prompt, temperature=0.0, max_tokens=40, ignore_eos=True)[0]
        body = {"return_token_ids": True, "ignore_eos": True}
        whole = server.client().completions.create(model=MODEL, prompt=prompt, temperature=0.0,
                                                   max_tokens=40, extra_body=body)
        streamed = stream_choices(server.client().completions.create(
            model=MODEL, prompt=prompt, temperature=0.0, max_tokens=40, stream=True,
            extra_body=body))[0]
        assert whole.choices[0].token_ids == streamed["ids"] == want.token_ids
        assert whole.choices[0].text == streamed["text"] == want.text
        # Accepted drafts arrive with the token after them, in one chunk.
        assert len([p for p in streamed["pieces"] if p]) < len(want.token_ids)
        text = httpx.get(f"{server.base}/metrics", timeout=10).text
        samples = {s.name + "".join(f"[{v}]" for k, v in s.labels.items() if k == "position"):
                   s.value for f in text_string_to_metric_families(text) for s in f.samples}
        stats = engine.engine_core.scheduler.spec_decoding_stats
        assert samples["vllm:spec_decode_num_drafts_total"] == stats.num_drafts > 0
        assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
        accepted = samples["vllm:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted == stats.num_accepted_tokens
        assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total[0]"] > 0
    finally:
        server.stop()
        engine.shutdown()
    assert "vllm:spec_decode_num_drafts" not in httpx.get(f"{served.base}/metrics").text, (
        "an engine that does not speculate exports no spec_decode metric, as upstream")
