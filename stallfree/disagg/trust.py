"""Which prefill servers a decode server talks to: the operator's list
(`disaggregation.prefill_hosts`, `host:port` entries), or, with none given, any prefill on a
loopback address. A request only names a prefill; it never widens the list, so no client can
make a decode server connect anywhere else (nor read what an unlisted host answers)."""

from __future__ import annotations

import ipaddress

from stallfree.config.disagg import normalise_host, parse_endpoint

LOOPBACK_NAMES = ("localhost",)


class UntrustedPrefillError(ValueError):
    """A request or a connect call named a prefill this decode server was not told to trust."""


def is_loopback(host: str) -> bool:
    bare = normalise_host(host)
    if bare in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


class PrefillAllowList:
    """The prefill endpoints a decode server may pair with."""

    def __init__(self, entries: list[str]) -> None:
        self.endpoints = frozenset(parse_endpoint(e) for e in entries)

    def allows(self, host: str, port: int) -> bool:
        if not self.endpoints:
            return is_loopback(host)
        return (normalise_host(host), port) in self.endpoints

    def check(self, host: str, port: int) -> None:
        """Raise `UntrustedPrefillError` naming the setting unless `host:port` is trusted."""
        if self.allows(host, port):
            return
        raise UntrustedPrefillError(
            f"bootstrap_host {host!r} with bootstrap_port {port} is not a prefill server this "
            "decode server trusts (its disaggregation.prefill_hosts, --disagg-prefill-hosts; "
            "unset, loopback addresses only)"
        )
