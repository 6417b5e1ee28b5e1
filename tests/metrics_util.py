"""Reading a Prometheus scrape in tests, and a made-up engine snapshot to render one from."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stallfree.runtime.telemetry.stats import EngineCounters, EngineSnapshot, PoolUsage


def samples(text: bytes | str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels without model_name/engine): value} of a scrape."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape.get((name, frozenset(labels.items())), 0.0)


def fake_snapshot(**fields: Any) -> EngineSnapshot:
    """A fixed snapshot (2 running, 3 waiting, 5 generated tokens, ...); `fields` replace parts."""
    base = dict(
        running=2,
        waiting=3,
        pools=PoolUsage(
            req_slots_free=4, req_slots_total=8, kv_tokens_free=25, kv_tokens_total=100
        ),
        counters=EngineCounters(prompt_tokens=11, generation_tokens=5, steps=9, overlap_steps=4),
        stalls={"schedule.page_count": 6},
        stall_seconds={"schedule.page_count": 0.5},
        mirror_reads={"seq_lens_cpu": 7},
        device_busy_seconds=1.5,
        device_idle_seconds=0.25,
    )
    return EngineSnapshot(**(base | fields))
