"""The route handlers: `/health`, `/metrics`, `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, `/generate`, the utility routes (`/tokenize`, `/abort_request`, ...)
and a disaggregated server's `/disagg/connect`."""
