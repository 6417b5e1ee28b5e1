"""The `replicas` section: data-parallel replicas of one model behind one HTTP front."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stallfree.config.sections import Section


class ReplicaConfig(Section):
    """`data_parallel_size` engines, each a whole server in its own process (its own scheduler,
    KV pool and tensor-parallel ranks), behind one front that places each request on one of
    them (docs/replicas.md)."""

    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Engines serving the model, each in its own process; 1: no front",
    )
    policy: Literal["cache_aware", "least_load", "round_robin"] = Field(
        "cache_aware",
        description="How the front places a request: cache_aware sends it to the replica that "
        "last saw the longest prefix of its prompt unless the load is out of balance, else to "
        "the least loaded; least_load: fewest requests in flight; round_robin: in turn",
    )
    cache_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="cache_aware: the share of the prompt a replica's prefix must cover for the "
        "request to follow it",
    )
    balance_abs_threshold: int = Field(
        32,
        ge=0,
        description="cache_aware: load counts as out of balance when the busiest replica has "
        "more than this many requests in flight beyond the idlest ...",
    )
    balance_rel_threshold: float = Field(
        1.5, ge=1, description="... and more than this many times as many"
    )
    prefix_block_chars: int = Field(
        32,
        ge=1,
        le=4096,
        description="cache_aware: prompts are matched in blocks of this many characters (a "
        "token-id prompt: its ids written out, comma after each)",
    )
    prefix_blocks: int = Field(
        1 << 16,
        ge=1,
        description="cache_aware: prompt blocks remembered per replica; the least recently "
        "used are forgotten beyond it",
    )
    startup_timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="How long the replicas may take to load the model and answer /health",
    )
    request_timeout_s: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="How long the front waits for a replica's next byte before it fails the request",
    )
