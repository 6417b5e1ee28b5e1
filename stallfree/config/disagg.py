"""The `disaggregation` section: prefill/decode disaggregation."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from stallfree.config.sections import Section


def parse_endpoint(entry: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` for an IPv6 address) as a normalised (host, port)."""
    host, sep, port = entry.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"a prefill endpoint is host:port, not {entry!r}")
    return normalise_host(host), int(port)


def normalise_host(host: str) -> str:
    """A host as compared: lower case, an IP address in its canonical form, no brackets."""
    bare = host.strip().removeprefix("[").removesuffix("]").lower()
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare


class DisaggregationConfig(Section):
    """Prefill/decode disaggregation (docs/disaggregation.md): a prefill server computes a
    prompt's KV and first token, a decode server receives them page by page and decodes."""

    mode: Literal["null", "prefill", "decode"] = Field(
        "null",
        description="null: colocated; prefill: compute prompts and hand their KV over; "
        "decode: receive prefilled KV and decode",
    )
    transfer_backend: Literal["auto", "gloo", "nccl", "loopback"] = Field(
        "auto",
        description="How KV moves: torch.distributed point-to-point over gloo (CPU) or NCCL "
        "(GPU; auto picks by device), or loopback (two engines in one process)",
    )
    bootstrap_host: str = Field(
        "127.0.0.1",
        description="prefill: the address the bootstrap endpoint binds (the pairs' groups meet "
        "through it)",
    )
    bootstrap_port: int = Field(
        8998, ge=0, le=65535, description="prefill: bootstrap endpoint port; 0 picks a free one"
    )
    prefill_hosts: list[str] = Field(
        default_factory=list,
        description="decode: the prefill bootstrap endpoints (host:port) it may pair with; a "
        "request naming any other is refused. Empty: prefill servers on loopback addresses only",
    )
    secret: str | None = Field(
        None,
        min_length=16,
        max_length=4096,
        description="The shared secret both sides of a deployment hold: the prefill's "
        "bootstrap endpoint refuses every call without it, the decode side sends it. Set it "
        "through STALLFREE_DISAGGREGATION__SECRET (or a config file) to keep it off the command "
        "line. Unset: no authentication, so the endpoint should be reachable from loopback only",
    )
    pair_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="prefill: how long a pair waits for its decode side to join its group; a "
        "pair nobody joins is dropped then",
    )
    bootstrap_max_body_bytes: int = Field(
        8 << 20,
        ge=1024,
        description="prefill: the largest body the bootstrap endpoint reads (a 413 beyond); "
        "8 MiB holds a registration of about a million pages, read in about 70 ms",
    )
    max_rooms: int = Field(65536, ge=1, description="prefill: rooms open at once (a 429 beyond)")
    max_rooms_per_pair: int = Field(
        4096,
        ge=1,
        description="prefill: rooms one decode server (one pair) may register at once (a 429 "
        "beyond)",
    )
    bootstrap_timeout_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="A room's deadline to pair up: prefill waits for decode's destination "
        "pages, decode for its pages and the handshake",
    )
    transfer_timeout_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="A paired room's deadline: decode waits for the KV, prefill for the "
        "acknowledgement (then frees its copy)",
    )
    stall_timeout_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="Every request in a disaggregated role: the longest it may go without "
        "progress (decode: to its first token, then between tokens; prefill: to its answer); "
        "beyond it the request ends with a 504 naming this setting",
    )
    heartbeat_interval_s: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="decode: how often it probes each prefill"
    )
    heartbeat_max_failures: int = Field(
        2, ge=1, description="decode: failed probes in a row that fail every room of a prefill"
    )

    @field_validator("prefill_hosts")
    @classmethod
    def _endpoints(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            parse_endpoint(entry)
        return entries

    @property
    def enabled(self) -> bool:
        return self.mode != "null"
