"""`ScheduledPoolingEngine`: the pooling runner of a decoder embedder (a native family's hidden
states, Qwen3-Embedding's shape), on the generating engine's scheduler.

It is the generating `Engine` with generation refused: its requests are `embed` calls, each
input a prefill-only request (`embed_requests.py`), admitted, batched and chunked as a prompt,
counted in the same metrics, run with the mirrors and overlap as configured. The prefix cache is
off on this runner: pooling requests never use it, and nothing else runs here.
"""

from __future__ import annotations

from collections.abc import Sequence

from stallfree.config import StallfreeConfig
from stallfree.runtime.engine import Engine
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.pooled import Pooled
from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.request.req import Req


class ScheduledPoolingEngine(Engine):
    """An `Engine` whose requests are embeddings: `embed` is its request, generation a 400."""

    runner = "pooling"
    task = "embed"

    def __init__(self, config: StallfreeConfig) -> None:
        cache = config.cache.model_copy(update={"prefix_caching": False})
        super().__init__(config.model_copy(update={"cache": cache}))
        if self.embeddings is None:
            self.core.stream.close()
            raise ModelLoadError(self.embed_refusal)
        self.max_context_len = self.embeddings.max_len

    def _new_req(self, prompt: object, params: object, rid: object) -> Req:
        raise InvalidRequestError(
            "this server runs the pooling runner: it serves /v1/embeddings, not generation"
        )

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
