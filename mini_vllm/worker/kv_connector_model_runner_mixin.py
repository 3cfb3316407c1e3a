"""A model runner with a KV connector's worker side around each step (lab 04-06).

:class:`KVConnectorRunner` wraps any runner: before the step it binds the scheduler's connector
metadata and starts the loads; each attention layer waits for its loads before it attends and
saves its blocks after it wrote its cache (:class:`ConnectorAttention`, around the runner's
attention backend); after the forward pass the saves complete. A step with loads or saves runs
layer by layer (not as the CPU's one compiled decode call, which has no place for the hooks).

upstream: vllm/v1/worker/kv_connector_model_runner_mixin.py:23 @ v0.33.0 (the step's hooks; the
layer's are vllm/model_executor/layers/attention/kv_transfer_utils.py:15 @ v0.33.0)
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConnectorAttention", "ConnectorAttentionBase", "KVConnectorRunner", "layer_name"]


def layer_name(index: int) -> str:
    """The name a connector knows layer ``index``'s cache by.

    upstream: none (upstream's layer names are the attention modules' prefixes, as this one)
    """
    return f"model.layers.{index}.self_attn"


class ConnectorAttentionBase:
    """An attention backend around ``inner`` (the runner's), with ``connector`` (its worker
    side) and :meth:`layer_of` (the model hands the backend a layer's caches, not its index);
    every attribute but the call is ``inner``'s. :class:`ConnectorAttention` adds the call.

    upstream: vllm/model_executor/layers/attention/kv_transfer_utils.py:15 @ v0.33.0
    """

    def __init__(self, inner: Any, connector: Any,
                 kv_caches: list[tuple[Any, Any]]) -> None:
        self.inner = inner
        self.connector = connector
        self._names = {k.data_ptr(): layer_name(i) for i, (k, _) in enumerate(kv_caches)}

    def layer_of(self, key_cache: Any) -> str:
        """The name of the layer whose key cache is ``key_cache``."""
        return self._names[key_cache.data_ptr()]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


class ConnectorAttention(ConnectorAttentionBase):
    """Attention with the connector's per-layer hooks around it (lab 04-06, task 4).

    upstream: vllm/model_executor/layers/attention/kv_transfer_utils.py:15 @ v0.33.0
    """

    def __call__(self, query, key, value, key_cache, value_cache, meta, scale):
        """``inner``'s attention for this layer, after ``wait_for_layer_load`` (the layer may
        read blocks loaded in this step) and before ``save_kv_layer`` (``inner`` writes the
        step's K/V into the cache first: a block saved earlier would hold stale K/V).

        upstream: vllm/model_executor/layers/attention/kv_transfer_utils.py:15 @ v0.33.0
        """
        name = self.layer_of(key_cache)
        self.connector.wait_for_layer_load(name)
        out = self.inner(query, key, value, key_cache, value_cache, meta, scale)
        self.connector.save_kv_layer(name, (key_cache, value_cache), meta)
        return out


class KVConnectorRunner:
    """``runner`` with ``connector``'s worker side around every step (see the module
    docstring). Everything else is ``runner``'s.

    upstream: vllm/v1/worker/kv_connector_model_runner_mixin.py:23 @ v0.33.0
    """

    def __init__(self, runner: Any, connector: Any) -> None:
        self.runner = runner
        self.connector = connector
        connector.register_kv_caches(
            {layer_name(i): kv for i, kv in enumerate(runner.kv_caches)})
        runner.attn_backend = ConnectorAttention(runner.attn_backend, connector,
                                                 runner.kv_caches)

    def execute_model(self, scheduler_output: Any) -> Any:
        meta = scheduler_output.kv_connector_metadata
        self.connector.bind_connector_metadata(meta)
        fused = getattr(self.runner, "fused_decode", None)
        try:
            self.connector.start_load_kv()
            if meta is not None and meta.has_work:
                self.runner.fused_decode = None  # this step's layers must call the hooks
            output = self.runner.execute_model(scheduler_output)
            if not scheduler_output.total_num_scheduled_tokens:  # no layer ran: load anyway
                for i in range(len(self.runner.kv_caches)):
                    self.connector.wait_for_layer_load(layer_name(i))
            self.connector.wait_for_save()
            return output
        finally:
            if fused is not None:
                self.runner.fused_decode = fused
            self.connector.clear_connector_metadata()

    def shutdown(self) -> None:
        self.connector.shutdown()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.runner, attr)
