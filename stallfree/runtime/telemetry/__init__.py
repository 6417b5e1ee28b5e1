"""Telemetry: counters, the engine snapshot, observers and the request log."""
