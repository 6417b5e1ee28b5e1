"""Speculative decoding's stream side, built from the configuration: the proposer (n-gram
lookup, or a draft model loaded beside the target with a KV cache of its own) inside a
`SpecDecoder`, and room in the future map for drafts and histories. `build_core` calls it
while it wires the in-process executor, and each worker process (`execution/worker.py`) while
it builds its rank; with workers the host only marks its context (`mark_spec`)."""

from __future__ import annotations

from stallfree.config import SpeculativeConfig
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


def mark_spec(spec: SpeculativeConfig, ctx: BatchContext) -> None:
    """The host facts the scheduler and the planner read: drafts per step, and whether a draft
    model runs (its batches are planned on the host)."""
    ctx.spec_k = spec.num_speculative_tokens
    ctx.spec_draft_model = spec.method == "draft_model"


def build_spec_decoder(
    spec: SpeculativeConfig,
    ctx: BatchContext,
    loaded: LoadedModel,
    sampler: Sampler,
    model: tuple[str, str, int],
) -> SpecDecoder | None:
    """Speculative decoding's stream side, and room for drafts and histories in the future
    map (before the runner hands the map's tensors to the stream). `model`: the model's
    configured dtype, quantization and seed, which a draft model loads with."""
    if not spec.enabled:
        return None
    mark_spec(spec, ctx)
    k = spec.num_speculative_tokens
    width = ctx.req_to_token_pool.req_to_token.shape[1]
    ctx.future_map.enable_spec(k, width + k + 2)
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        proposer = _load_draft_model(spec, ctx, loaded, model)
    return SpecDecoder(proposer, sampler, ctx.future_map)


def _load_draft_model(
    spec: SpeculativeConfig, ctx: BatchContext, target: LoadedModel, model: tuple[str, str, int]
) -> DraftModelProposer:
    """The draft model, in the target's dtype and quantization, with a KV cache of the
    target's token slots. It must share the target's vocabulary."""
    path = spec.draft_model
    assert path is not None
    dtype, quantization, seed = model
    try:
        draft = load_model(path, dtype, ctx.kv_cache.device, seed, None, quantization)
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
