"""`EmbedRequests`: embeddings on the generating engine's scheduler, for a native decoder
family (a Qwen3-Embedding-shaped model, or the chat model a generation server already runs).

Each input of an `embed` call is a prefill-only request (`Req.pooling`): admitted, batched and
chunked as a prompt, in steps of pooling requests only (scheduling/prefill.py), counted in the
same metrics, run with the mirrors and overlap as configured. A step of such requests sums each
row's final hidden states on the stream instead of sampling (`execution/planner.py`
`PoolPlan`); the sums are read with the step's token ids, after its event. A request finishes
after its last chunk, with no token, and its KV pages go back to the pool. Pooling requests
never use the prefix cache: a cached prefix would skip hidden states a mean needs, and their
KV is not offered to anyone else.

Both the pooling runner of a decoder embedder (`scheduled_pooler.py`) and a generating `Engine`
whose model pools hold one of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stallfree.config import StallfreeConfig
from stallfree.runtime.core import EngineCore
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.model.decoder_embedder import DecoderEmbedder
from stallfree.runtime.model.pooling import (
    PoolingConfig,
    check_dimensions,
    finish,
    read_pooling_config,
    with_override,
)
from stallfree.runtime.pooled import Pooled, PoolingAborted
from stallfree.runtime.request.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    check_waiting_room,
)
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.request_table import RequestTable
from stallfree.runtime.text.output_processor import RequestStream
from stallfree.runtime.text.pooling_inputs import InputReader

# the pooling modes a step sums on the stream (the others need every hidden state at once)
SCHEDULED_MODES = ("last", "mean", "cls", "mean_sqrt_len")


def pooling_refusals(config: StallfreeConfig) -> list[str]:
    """The settings under which an engine pools nothing (each named)."""
    return [
        name
        for name, on in (
            ("disaggregation.mode", config.disaggregation.mode != "null"),
            ("parallel.tp_size > 1", config.parallel.tp_size > 1),
            ("hisparse.enabled", config.hisparse.enabled),
            ("speculative.enabled", config.speculative.enabled),
            ("worker processes", config.uses_worker_processes),
        )
        if on
    ]


@dataclass(slots=True, eq=False)
class EmbedRequests:
    """An engine's embeddings: `embed` queues one pooling request per input and waits for
    their vectors; `abort` ends every input of a call by the call's id."""

    requests: RequestTable
    pooling: PoolingConfig
    inputs: InputReader  # its `max_len`: the longest input (the context, or the checkpoint's)
    groups: dict[str, list[Req]] = field(default_factory=dict)  # each call's inputs, by its id

    @property
    def max_len(self) -> int:
        return self.inputs.max_len

    def check_dimensions(self, dimensions: int | None) -> None:
        check_dimensions(self.pooling, dimensions)

    def __contains__(self, rid: object) -> bool:
        return isinstance(rid, str) and rid in self.groups  # a list would not even hash

    def abort(self, rid: str) -> bool:
        """Abort an `embed` call by its id (it raises `PoolingAborted`)."""
        reqs = self.groups.get(rid, [])
        return any([self.requests.abort(req.rid) for req in reqs])

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None,
        truncate_prompt_tokens: int | None,
        timeout: float | None,
        rid: str,
    ) -> Pooled:
        """Pool each input into one vector: one scheduled request per input."""
        self.check_dimensions(dimensions)
        ids = self.inputs.singles(inputs, truncate_prompt_tokens)
        if rid in self.groups or rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        core = self.requests.core  # each input waits as one request: all fit, or none is queued
        check_waiting_room(
            core.scheduler.queues.num_waiting, len(ids.ids), core.max_waiting_requests
        )
        reqs = [self._pool_req(f"{rid}#{i}", row) for i, row in enumerate(ids.ids)]
        streams: list[RequestStream] = []
        self.groups[rid] = reqs
        try:
            for req in reqs:  # all queued before the first wait: `abort` reaches each one
                streams.append(self.requests.submit(req, wake_per_step=False))
            drains = (self._drain(r, s, timeout) for r, s in zip(reqs, streams, strict=False))
            await asyncio.gather(*drains)
        finally:
            del self.groups[rid]
            for req in reqs[: len(streams)]:
                if not req.finished:  # a drain that never ran (a submit failed)
                    self.requests.abort(req.rid)
                self.requests.unregister(req)
        _raise_unfinished(reqs)
        vectors = torch.stack([req.pooled for req in reqs if req.pooled is not None])
        return Pooled(finish(vectors, self.pooling, dimensions), ids.num_tokens)

    def _pool_req(self, rid: str, ids: list[int]) -> Req:
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        return Req(
            rid=rid,
            origin_input_ids=list(ids),
            sampling_params=SamplingParams(max_new_tokens=1),
            max_context_len=self.max_len,
            pooling=self.pooling.mode,
        )

    async def _drain(self, req: Req, stream: RequestStream, timeout: float | None) -> None:
        async with contextlib.aclosing(self.requests.drain(req, stream, timeout)) as chunks:
            async for _ in chunks:
                pass


def build_embed_requests(
    config: StallfreeConfig, core: EngineCore, requests: RequestTable, max_context_len: int
) -> EmbedRequests:
    """The embeddings of `core`'s model; `ModelLoadError` saying why when it cannot pool (a
    setting above, a model that is not a plain native family, a pooling mode no step sums)."""
    refused = pooling_refusals(config)
    if refused:
        raise ModelLoadError(f"pooling does not take {', '.join(refused)}")
    if core.loaded is None:
        raise ModelLoadError("pooling runs the model in this process")
    embedder = DecoderEmbedder(core.loaded)  # a plain native family, one rank
    pooling = _pooling_config(config, embedder.hidden_size)
    core.ctx.pool_width = embedder.hidden_size
    max_len = max_context_len
    if pooling.max_seq_length is not None:
        max_len = min(max_len, pooling.max_seq_length)
    inputs = InputReader(core.tokenizer, core.arch.vocab_size, max_len)
    return EmbedRequests(requests, pooling, inputs)


def _raise_unfinished(reqs: list[Req]) -> None:
    """An input that did not finish with its vector: the embed call's error."""
    for req in reqs:
        if req.finished_reason is FinishReason.STOP and req.pooled is not None:
            continue
        message = req.finish_message or "the request was aborted"
        if req.finished_reason is FinishReason.ABORT:
            if message.startswith("deadline"):
                raise TimeoutError(message)
            raise PoolingAborted(message)
        if req.error_status is not None and 400 <= req.error_status < 500:
            raise InvalidRequestError(message)
        raise EngineUnhealthyError(f"the pooling step failed: {message}")


def _pooling_config(config: StallfreeConfig, hidden_size: int) -> PoolingConfig:
    """The checkpoint's pooling (a decoder's default: the last token, normalised), as the
    step sums it."""
    path = Path(config.model.path)
    try:
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        model_config = {}
    if not isinstance(model_config, dict):
        model_config = {}
    pooling = with_override(
        read_pooling_config(
            path, model_config, hidden_size, default_mode="last", default_normalize=True
        ),
        config.model.override_pooler_config,
    )
    if pooling.mode not in SCHEDULED_MODES:
        raise ModelLoadError(
            f"{pooling.mode} pooling is not served for decoder embedders; "
            f"they take {', '.join(SCHEDULED_MODES)}"
        )
    return pooling
