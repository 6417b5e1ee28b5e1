"""Prefill/decode disaggregation: a prefill server computes a prompt's KV and first token, a
decode server receives the KV page run by page run and decodes (docs/disaggregation.md)."""
