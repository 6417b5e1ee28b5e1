"""The HiSparse attention backend: dense layers pass through, sparse layers use the coordinator.

Runs on the stream (inside the model's forward), so it may read device tensors; the host
metadata it loops over (`fb.*_cpu`, the decode plan) was fixed at schedule time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stallfree.hisparse.coordinator import DecodePlan, ExtendPlan
from stallfree.hisparse.indexer import query_proxy
from stallfree.runtime.model.attention import attend, attend_batched, causal_mask
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from stallfree.hisparse.coordinator import HisparseCoordinator
    from stallfree.runtime.model.llama import AttentionBackend


class HisparseAttention:
    def __init__(self, coordinator: HisparseCoordinator, dense: AttentionBackend) -> None:
        self.coordinator = coordinator
        self.dense = dense

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        li = self.coordinator.layer_index.get(layer_id)
        if li is None:
            return self.dense.forward(q, k, v, layer_id, fb)
        if fb.mode is ForwardMode.DECODE:
            return self._decode(q, k, v, li, layer_id, fb)
        return self._extend(q, k, v, li, fb)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, li: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """Causal attention over the prompt, reading the prefix back from the host pool.

        Exact and dense, except at output positions of a re-prefill: those attend as in decode.
        """
        co = self.coordinator
        plan = fb.sparse_plan
        assert isinstance(plan, ExtendPlan)
        co.write_extend(li, fb.out_cache_loc, k, v)
        outs = []
        start = 0
        for i in range(fb.batch_size):
            n, prefix = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
            seq = prefix + n
            row = int(fb.req_pool_indices_cpu[i])
            k_seq, v_seq = co.host_kv(li, fb.req_to_token[row, :seq])
            mask = causal_mask(prefix, seq, q.device)
            # positions past the prompt are outputs of a re-prefill after retraction
            co.mask_decoded(li, row, prefix, fb.prompt_lens_cpu[i], q[start : start + n], mask)
            outs.append(attend(q[start : start + n], k_seq, v_seq, mask))
            start += n
        co.admit_on_stream(li, plan)
        return torch.cat(outs) if outs else q.new_empty(q.shape)

    def _decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        li: int,
        layer_id: int,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """Attend over each row's selected (or, when short, all) buffer slots plus the reserved."""
        co = self.coordinator
        plan = fb.sparse_plan
        assert isinstance(plan, DecodePlan)
        co.write_decode(li, plan, fb.out_cache_loc, k, v)
        bs, width = len(plan.rows), plan.width
        phys = torch.zeros((bs, width + 1), dtype=torch.int64, device=q.device)
        valid = torch.zeros((bs, width + 1), dtype=torch.bool, device=q.device)
        stride = co.buffers.stride
        selecting = [i for i in range(bs) if plan.select[i]]
        if selecting:
            topk = torch.stack(
                [
                    co.select(li, plan.rows[i], plan.n_prev[i], query_proxy(q[i : i + 1])[0])
                    for i in selecting
                ]
            )
            n_prev = [plan.n_prev[i] for i in selecting]
            slots = co.swap_in_selected(plan.sel_rows, n_prev, topk, layer_id, plan.step)
            phys[plan.sel_index, : co.top_k] = plan.sel_rows[:, None] * stride + slots
            valid[plan.sel_index, : co.top_k] = True
        for i in range(bs):
            if not plan.select[i]:  # short: every earlier token is resident
                n, row = plan.n_prev[i], plan.rows[i]
                phys[i, :n] = row * stride + co.resident_slots(li, row, n)
                valid[i, :n] = True
        phys[:, width] = plan.reserved
        valid[:, width] = True
        buf, fmt = co.buffers, co.kv_format
        k_rows, v_rows = buf.k[li][phys], buf.v[li][phys]
        if fmt.quantized:
            k_rows, v_rows = fmt.decode(k_rows), fmt.decode(v_rows)
        out = attend_batched(q[:, :, None, :], k_rows, v_rows, valid[:, None, None, :])
        return out[:, :, 0, :]
