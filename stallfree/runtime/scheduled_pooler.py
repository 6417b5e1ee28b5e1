"""`ScheduledPoolingEngine`: the pooling runner of a decoder embedder (a native family's hidden
states, Qwen3-Embedding's shape), on the generating engine's scheduler.

Each input is a prefill-only request (`Req.pooling`): admitted, batched and chunked as a
prompt, counted in the same metrics, run with the mirrors and overlap as configured. A step of
such requests sums each row's final hidden states on the stream instead of sampling
(`execution/planner.py` `PoolPlan`); the sums are read with the step's token ids, after its
event. A request finishes after its last chunk, with no token, and its KV pages go back to
the pool. The prefix cache is off on this runner: a cached prefix would skip the hidden
states mean pooling needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from stallfree.config import StallfreeConfig
from stallfree.runtime.engine import Engine
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
)
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.text.output_processor import RequestStream
from stallfree.runtime.text.pooling_inputs import InputReader

# the pooling modes a step sums on the stream (the others need every hidden state at once)
SCHEDULED_MODES = ("last", "mean", "cls", "mean_sqrt_len")


class ScheduledPoolingEngine(Engine):
    """An `Engine` whose requests are embeddings: `embed` is its request, generation a 400."""

    runner = "pooling"
    task = "embed"

    def __init__(self, config: StallfreeConfig) -> None:
        cache = config.cache.model_copy(update={"prefix_caching": False})
        super().__init__(config.model_copy(update={"cache": cache}))
        try:
            if self.core.loaded is None:
                raise ModelLoadError("the pooling runner runs its model in this process")
            embedder = DecoderEmbedder(self.core.loaded)  # a plain native family, one rank
            self.pooling = _pooling_config(self.config, embedder.hidden_size)
        except BaseException:
            self.core.stream.close()
            raise
        self.core.ctx.pool_width = embedder.hidden_size
        if self.pooling.max_seq_length is not None:
            self.max_context_len = min(self.max_context_len, self.pooling.max_seq_length)
        self.inputs = InputReader(self.tokenizer, self.vocab_size, self.max_context_len)
        self._groups: dict[str, list[Req]] = {}  # the inputs of each embed call, by its id

    def _new_req(self, prompt: object, params: object, rid: object) -> Req:
        raise InvalidRequestError(
            "this server runs the pooling runner: it serves /v1/embeddings, not generation"
        )

    def check_dimensions(self, dimensions: int | None) -> None:
        check_dimensions(self.pooling, dimensions)

    def abort(self, rid: str) -> bool:
        """Abort an `embed` call by its id (it raises `PoolingAborted`)."""
        self._check_caller()
        reqs = self._groups.get(rid, [])
        return any([self.requests.abort(req.rid) for req in reqs])

    async def score(
        self,
        pairs: Sequence[tuple[str, str]],
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> Pooled:
        """Refused: scoring takes a cross-encoder."""
        raise InvalidRequestError(
            "this model is an embedder: it serves /v1/embeddings; /v1/score and /v1/rerank "
            "need a cross-encoder"
        )

    async def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> Pooled:
        """Pool each input into one vector: one scheduled request per input."""
        self._check_admission(rid)
        self.check_dimensions(dimensions)
        ids = self.inputs.singles(inputs, truncate_prompt_tokens)
        deadline = self._timeout(timeout)
        rid = rid or f"embd-{next(self._rid_counter)}"
        if rid in self._groups:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        reqs = [self._pool_req(f"{rid}#{i}", row) for i, row in enumerate(ids.ids)]
        streams = []
        self._groups[rid] = reqs
        try:
            for req in reqs:  # all queued before the first wait: `abort` reaches each one
                streams.append(self.requests.submit(req, wake_per_step=False))
            drains = (self._drain(r, s, deadline) for r, s in zip(reqs, streams, strict=False))
            await asyncio.gather(*drains)
        finally:
            del self._groups[rid]
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
            max_context_len=self.max_context_len,
            pooling=self.pooling.mode,
        )

    async def _drain(self, req: Req, stream: RequestStream, timeout: float | None) -> None:
        async with contextlib.aclosing(self.requests.drain(req, stream, timeout)) as chunks:
            async for _ in chunks:
                pass


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
