"""Forward batches built by hand for model-level tests: request rows and scattered KV slots,
no scheduler. Used by the model, GGUF and tensor-parallel tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from stallfree.runtime.memory.pool import KVCache, KVCacheShape, ReqToTokenPool
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode

CPU = torch.device("cpu")
PROMPT_A = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108]  # 12 tokens
PROMPT_B = [256, 84, 104, 101, 32, 113, 117, 105, 99]  # 9 tokens


class Harness:
    """Request rows and KV slots by hand; slots come from a shuffled free list so a
    request's KV is scattered, as it is with real paging.

    `kv_shape` defaults to the model's own (every KV head); a tensor-parallel rank passes its
    shard's (`LoadedModel.kv_cache_shape()`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int = 512,
        num_reqs: int = 4,
        max_context: int = 256,
        kv_shape: KVCacheShape | None = None,
    ) -> None:
        if kv_shape is None:
            arch = model.arch
            kv_shape = KVCacheShape(arch.num_layers, arch.num_kv_heads, arch.head_dim)
        self.model = model
        self.pool = ReqToTokenPool(num_reqs, max_context, CPU)
        self.kv = KVCache(kv_shape, num_slots, torch.float32, CPU)
        self.free = list(range(1, num_slots))  # slot 0 is padding
        random.Random(0).shuffle(self.free)
        self.lens: dict[int, int] = {}

    def batch(
        self,
        mode: ForwardMode,
        reqs: list[tuple[int, list[int]]],
        logit_positions: list[int] | None = None,
    ) -> ForwardBatch:
        ids, positions, locs, prefixes = [], [], [], []
        for row, tokens in reqs:
            prefix = self.lens.get(row, 0)
            new = [self.free.pop() for _ in tokens]
            self.pool.req_to_token[row, prefix : prefix + len(tokens)] = torch.tensor(new)
            self.lens[row] = prefix + len(tokens)
            ids += tokens
            positions += range(prefix, prefix + len(tokens))
            locs += new
            prefixes.append(prefix)
        rows = torch.tensor([row for row, _ in reqs])
        seq_lens = torch.tensor([self.lens[row] for row, _ in reqs])
        return ForwardBatch(
            mode=mode,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            out_cache_loc=torch.tensor(locs),
            req_pool_indices=rows,
            seq_lens=seq_lens,
            req_pool_indices_cpu=rows.clone(),
            seq_lens_cpu=seq_lens.clone(),
            extend_lens_cpu=[len(t) for _, t in reqs],
            prefix_lens_cpu=prefixes,
            req_to_token=self.pool.req_to_token,
            kv_cache=self.kv,
            logit_positions=None if logit_positions is None else torch.tensor(logit_positions),
        )

    def run(
        self,
        mode: ForwardMode,
        reqs: list[tuple[int, list[int]]],
        logit_positions: list[int] | None = None,
    ) -> torch.Tensor:
        return self.model(self.batch(mode, reqs, logit_positions))


def check_chunked_prefill_then_decode(
    model: torch.nn.Module, model_dir: Path, steps: int = 3, atol: float = 1e-4
) -> None:
    """`model` against transformers on the checkpoint `model_dir`: A's prompt in two chunks
    (slots 2 and 0: request slots need not be in order) beside B's whole prompt, then `steps`
    greedy decode steps of both; every row's logits within `atol`, and the greedy tokens."""
    from tests.hf_models import hf_greedy, hf_logits

    h = Harness(model)
    gen_a, gen_b = hf_greedy(model_dir, PROMPT_A, steps), hf_greedy(model_dir, PROMPT_B, steps)
    ref_a, ref_b = hf_logits(model_dir, PROMPT_A + gen_a), hf_logits(model_dir, PROMPT_B + gen_b)
    first = h.run(ForwardMode.EXTEND, [(2, PROMPT_A[:7]), (0, PROMPT_B)])
    torch.testing.assert_close(first[0], ref_a[6], atol=atol, rtol=0)
    torch.testing.assert_close(first[1], ref_b[8], atol=atol, rtol=0)
    second = h.run(ForwardMode.EXTEND, [(2, PROMPT_A[7:])])
    torch.testing.assert_close(second[0], ref_a[11], atol=atol, rtol=0)
    assert int(second[0].argmax()) == gen_a[0] and int(first[1].argmax()) == gen_b[0]
    for step in range(steps):
        out = h.run(ForwardMode.DECODE, [(2, [gen_a[step]]), (0, [gen_b[step]])])
        torch.testing.assert_close(out[0], ref_a[12 + step], atol=atol, rtol=0)
        torch.testing.assert_close(out[1], ref_b[9 + step], atol=atol, rtol=0)
