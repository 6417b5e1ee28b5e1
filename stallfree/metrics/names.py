"""Metric names and label sets, in one place for the collector, the docs and the dashboard."""

from __future__ import annotations

PREFIX = "stallfree:"
BASE_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

# Every `site` a `host_read` names (the runtime's and HiSparse's), exported at 0 from the start
# so a dashboard shows 0 rather than "No data" (tests/metrics/test_metrics.py checks the list against
# the source).
STALL_SITES = (
    "schedule.page_count",
    "schedule.retract",
    "launch.req_pool_indices",
    "hisparse.map_last_loc",
)
# Every host mirror field a read can be served from, likewise exported at 0.
MIRROR_FIELDS = ("seq_lens_cpu", "req_pool_indices_cpu")
# Speculative decoding's families (vLLM's names). The counters are exported at 0 from the start,
# with speculation on or off. The per-position one has a `position` series for each draft position
# 0..k-1, at 0 from the start, while speculation is on; with it off there is no draft position, so
# it is declared (HELP and TYPE) with no series.
SPEC_DECODE_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SPEC_DECODE_FAMILIES = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_requests_disabled",
    SPEC_DECODE_PER_POS,
)
# Why the server refused a request (`http_refusals_total{reason}`), each exported at 0 from the
# start: too many in progress or a full queue; draining; a body over the limit; a body that did
# not arrive in time; no valid API key; anything else the client must change (a 4xx).
REFUSAL_REASONS = (
    "overloaded",
    "shutting_down",
    "body_too_large",
    "timeout",
    "unauthorized",
    "invalid_request",
)
