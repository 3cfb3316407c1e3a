"""Known-wrong edits of the server's pieces that the tests of lab 03-05 must reject."""

from course.integrity.bugs import PlantedBug

BUGS = [
    PlantedBug(
        name="splits-a-utf8-character",
        description="decode_next emits the window's text even when it ends inside a character, "
        "so a client receives U+FFFD and then the character's own text",
        file="mini_vllm/engine/detokenizer.py",
        find="if not final and (window_text.endswith(REPLACEMENT_CHAR)\n"
        "                          or len(window_text) <= len(prefix_text)):",
        replace="if not final and len(window_text) <= len(prefix_text):",
    ),
    PlantedBug(
        name="re-emits-the-context",
        description="decode_next returns the whole window's text, context included, so each "
        "piece repeats the text of the token before it",
        file="mini_vllm/engine/detokenizer.py",
        find="return window_text[len(prefix_text):]",
        replace="return window_text",
    ),
    PlantedBug(
        name="re-decodes-the-whole-output",
        description="the window's start never moves: every token re-decodes the whole output "
        "(the text is right, the cost is O(n) per token)",
        file="mini_vllm/engine/detokenizer.py",
        find="self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)",
        replace="self.read_offset = len(self.token_ids)",
    ),
    PlantedBug(
        name="abort-never-sent",
        description="a consumer that goes away leaves its request running in the engine: it "
        "keeps its KV blocks until max_tokens",
        file="mini_vllm/engine/async_llm.py",
        find="            if not finished:\n                self.abort(request_id)",
        replace="            if not finished:\n                pass",
    ),
    PlantedBug(
        name="abort-after-finish",
        description="generate aborts every request on its way out, finished ones too",
        file="mini_vllm/engine/async_llm.py",
        find="            if not finished:\n                self.abort(request_id)",
        replace="            self.abort(request_id)",
    ),
    PlantedBug(
        name="stream-stops-early",
        description="generate yields only what the collector holds now and stops when it is "
        "empty, ending the stream before the finished output",
        file="mini_vllm/engine/async_llm.py",
        find="out = collector.get_nowait() or await collector.get()",
        replace="out = collector.get_nowait()\n"
        "                if out is None:\n"
        "                    return",
    ),
    PlantedBug(
        name="missing-done",
        description="the stream of a completion never sends data: [DONE], so OpenAI clients "
        "wait for more",
        file="mini_vllm/entrypoints/openai/serving_completion.py",
        find='        yield sse_event("[DONE]")',
        replace="        return",
    ),
    PlantedBug(
        name="usage-counts-the-last-delta",
        description="the usage chunk counts only the last delta's tokens, not the whole "
        "completion's",
        file="mini_vllm/entrypoints/openai/serving_completion.py",
        find="completion_tokens += len(comp.token_ids)",
        replace="completion_tokens = len(comp.token_ids)",
    ),
    PlantedBug(
        name="usage-absent-from-ordinary-chunks",
        description="with include_usage only the last chunk has a usage field; OpenAI's other "
        "chunks carry \"usage\": null, and clients that read it on every chunk find none",
        file="mini_vllm/entrypoints/openai/serving_completion.py",
        find='chunk["usage"] = None  # as OpenAI: the counts come in the last chunk',
        replace="pass",
    ),
]
