"""KV handed over between servers (disaggregation), on the scheduler's side. A mix-in of
`Scheduler`.

Decode side: a request whose KV is on its way is *importing*: it holds its slot and pages
(`reserve_import`), counts against admission like a running request, and cannot be retracted
(it is in no batch) until it joins the decode batch with its first token (`join_prebuilt`).

Prefill side: a request marked `hold_kv` keeps its slot and pages when it finishes, until
`release_held` (the transfer was acknowledged, or its deadline passed); then they are freed as
for any finished request, and the prefix cache may keep the pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from stallfree.runtime.request.req import FinishReason, Req, ReqStatus
from stallfree.runtime.scheduling.prebuilt import (
    import_prebuilt_kv,
    release_prebuilt,
    reserve_prebuilt,
    stash_first_token,
)
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.scheduling.deferred import DeferredFrees


class Imports:
    # the fields and methods it uses (`Scheduler` declares them)
    ctx: BatchContext
    running_batch: ScheduleBatch | None
    deferred: DeferredFrees
    importing: dict[str, Req]
    _accept: Callable[..., None]

    def reserve_import(self, req: Req) -> bool:
        """Decode side, on the host: a slot, the prompt's pages and the `req_to_token` row for
        a request whose KV is coming. False, holding nothing, when there is no room now."""
        if not reserve_prebuilt(self.ctx, req):
            return False
        self.importing[req.rid] = req
        req.status = ReqStatus.RUNNING  # in no queue: an abort finishes it where it is
        return True

    def cancel_import(self, req: Req) -> None:
        """An importing request that will not join (its transfer failed, or it was aborted)."""
        if self.importing.pop(req.rid, None) is not None:
            if not req.finished:
                req.finish(FinishReason.ABORT, "KV import cancelled")
            release_prebuilt(self.ctx, req)

    def add_prebuilt(
        self, req: Req, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], first_token_id: int
    ) -> None:
        """Join a request whose prompt KV was computed elsewhere, its first token with it, all
        at once (`Engine.generate_prebuilt`). `kv` is checked already (`check_prebuilt`).
        Raises with nothing left behind if it cannot join."""
        req.check_grammar()
        import_prebuilt_kv(self.ctx, req, kv, first_token_id)
        self.importing[req.rid] = req
        self.join_prebuilt(req, first_token_id, stash=False)

    def join_prebuilt(self, req: Req, first_token_id: int, stash: bool = True) -> None:
        """An importing request whose KV is written (or submitted to the stream): stash its
        first token and join the decode batch through `prepare_for_prebuilt`, its slot and
        length taken from host facts. Raises with nothing left behind if it cannot join."""
        ctx = self.ctx
        assert self.importing.get(req.rid) is req, f"{req.rid} is not importing"
        try:
            if stash:
                stash_first_token(ctx, req, first_token_id)
            batch = ScheduleBatch.init_new([req], ctx)
            batch.prepare_for_prebuilt()
            del self.importing[req.rid]
            req.status = ReqStatus.RUNNING
            req.num_scheduled_outputs = 1
            self._accept(req, first_token_id, time.perf_counter())
            if req.wants_more_decode():
                assert self.running_batch is not None
                self.running_batch.merge_batch(batch)
        except BaseException:
            self.importing.pop(req.rid, None)
            if not req.finished:
                req.finish(FinishReason.ERROR, "prebuilt import failed")
                # NOTE: nothing launched reads these fresh slots: free at once
                release_prebuilt(ctx, req)
            raise

    def release_held(self, rid: str) -> bool:
        """Prefill side: free what a finished `hold_kv` request kept for its transfer."""
        return self.deferred.release_held(rid)
