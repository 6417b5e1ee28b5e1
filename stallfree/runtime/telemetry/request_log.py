"""Logging that is not on the hot path: the start-up line and opt-in per-request lines.

Loggers live under `stallfree` (`stallfree.runtime.*`). Nothing here runs per token: a request
is logged when it arrives and when it finishes (with `runtime.log_requests`), and the engine
logs one line when it starts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stallfree.runtime.telemetry.observer import EngineObserver

if TYPE_CHECKING:
    from stallfree.runtime.request.req import Req

logger = logging.getLogger(__name__)


def describe_reqs(reqs: list[Req], limit: int = 8) -> str:
    """Request ids for a log line, at most `limit` of them."""
    rids = ", ".join(r.rid for r in reqs[:limit])
    return rids + (f" and {len(reqs) - limit} more" if len(reqs) > limit else "")


class RequestLogger(EngineObserver):
    """`runtime.log_requests`: one INFO line when a request arrives and one when it finishes."""

    def on_request_added(self, req: Req) -> None:
        logger.info(
            "request %s arrived: %d prompt tokens, max_new_tokens %d",
            req.rid,
            len(req.origin_input_ids),
            req.sampling_params.max_new_tokens,
        )

    def on_request_finished(self, req: Req, now: float) -> None:
        reason = req.finished_reason.value if req.finished_reason is not None else "none"
        message = f" ({req.finish_message})" if req.finish_message else ""
        logger.info(
            "request %s finished: %s%s, %d prompt tokens, %d output tokens, %.3fs",
            req.rid,
            reason,
            message,
            len(req.origin_input_ids),
            len(req.output_ids),
            now - req.arrival_time,
        )
