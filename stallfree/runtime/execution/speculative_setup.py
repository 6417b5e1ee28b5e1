"""Speculative decoding's stream side, built from the configuration: the proposer (n-gram
lookup, or a draft model loaded beside the target with a KV cache of its own) inside a
`SpecDecoder`, and room in the future map for drafts and histories. `build_core` calls it
while it wires the in-process executor."""

from __future__ import annotations

from stallfree.config import StallfreeConfig
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.sampler import Sampler
from stallfree.runtime.execution.speculative import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SpecDecoder,
)
from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.model.loader import LoadedModel, load_model


def build_spec_decoder(
    config: StallfreeConfig, ctx: BatchContext, loaded: LoadedModel, sampler: Sampler
) -> SpecDecoder | None:
    """Speculative decoding's stream side, and room for drafts and histories in the future
    map (before the runner hands the map's tensors to the stream)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    k = spec.num_speculative_tokens
    ctx.spec_k = k
    width = ctx.req_to_token_pool.req_to_token.shape[1]
    ctx.future_map.enable_spec(k, width + k + 2)
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        proposer = _load_draft_model(config, ctx, loaded)
        ctx.spec_draft_model = True
    return SpecDecoder(proposer, sampler, ctx.future_map)


def _load_draft_model(
    config: StallfreeConfig, ctx: BatchContext, target: LoadedModel
) -> DraftModelProposer:
    """The draft model, in the target's dtype and quantization, with a KV cache of the
    target's token slots. It must share the target's vocabulary."""
    path = config.speculative.draft_model
    assert path is not None
    model = config.model
    try:
        draft = load_model(
            path, model.dtype, ctx.kv_cache.device, model.seed, None, model.quantization
        )
    except ModelLoadError as exc:
        raise ModelLoadError(f"speculative.draft_model: {exc}") from exc
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ModelLoadError(
            f"speculative.draft_model {path!r} has a vocabulary of {draft.arch.vocab_size} "
            f"tokens and the model {target.arch.vocab_size}: a draft model must share the "
            "target's tokenizer"
        )
    arch = draft.arch
    shape = KVCacheShape(arch.num_layers, arch.num_kv_heads, arch.head_dim)
    cache = KVCache(shape, ctx.kv_cache.num_slots, draft.dtype, ctx.kv_cache.device)
    ctx.stream.adopt(*cache.k_buffers, *cache.v_buffers)
    return DraftModelProposer(draft.model, cache)
