"""`stallfree router`'s flags and the settings they parse to.

No server extra here: the whole `stallfree` parser, this command's flags included, is built
with the base install, where fastapi and httpx may be absent. SGLang's router
spellings work: `--prefill URL [BOOTSTRAP_PORT]`, `--decode URL` (each repeated, one per
server) and `--pd-disaggregation`, accepted and ignored since this router is always
prefill/decode.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from stallfree.config.server import KEEP_ALIVE_S
from stallfree.entrypoints.flags import HelpFormatter, Table, add_flags, flag

# SGLang's default bootstrap port: where a prefill server's KV sender listens for decode servers
DEFAULT_BOOTSTRAP_PORT = 8998
POLICIES = ("round_robin", "least_load")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Upstream:
    """One server behind the router: its base URL (no trailing slash) and, for a prefill
    server, the bootstrap port decode servers fetch its KV from."""

    url: str
    bootstrap_port: int | None = None

    @property
    def host(self) -> str:
        """The URL's host, which is also where the prefill's bootstrap server listens."""
        return urlsplit(self.url).hostname or ""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything `stallfree router` runs with; `router_settings` builds it from the flags."""

    prefill: tuple[Upstream, ...]
    decode: tuple[Upstream, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    api_key: str | None = None
    startup_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    keep_alive_s: int = KEEP_ALIVE_S


def server_url(text: str) -> str:
    """An upstream's base URL: http or https with a host; a trailing slash is dropped."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a server URL: {text!r} (expected http://HOST:PORT)")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError(f"not a server URL: {text!r} (bad port)") from None
    return text.rstrip("/")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"not a port: {text!r} (expected 1-65535)")
    return port


class _ServerAction(argparse.Action):
    """`--prefill URL [BOOTSTRAP_PORT]` or `--decode URL`, repeatable: appends an `Upstream`
    (a prefill server's with its bootstrap port)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        prefill = self.nargs == "+"
        given = [values] if isinstance(values, str) else list(values or [])
        if prefill and not 1 <= len(given) <= 2:
            raise argparse.ArgumentError(self, "expected URL [BOOTSTRAP_PORT]")
        try:
            url = server_url(str(given[0]))
            port = port_number(given[1]) if len(given) == 2 else DEFAULT_BOOTSTRAP_PORT
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        server = Upstream(url, port) if prefill else Upstream(url)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), server])


class RouterHelpFormatter(HelpFormatter):
    """The shared help format; `--prefill` reads `URL [BOOTSTRAP_PORT]` (argparse would show
    a list of ports)."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, _ServerAction) and action.nargs == "+":
            return "URL [BOOTSTRAP_PORT]"
        return super()._format_args(action, default_metavar)


def _listen_port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be over 0, got {text}")
    return value


def _whole_seconds(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds over 0, got {text}")
    return value


def _bytes(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be over 0, got {text}")
    return value


_DEFAULT = RouterSettings((), ())
# fmt: off
ROUTER_FLAGS: Table = (
    ("servers (SGLang's spellings)", [
        flag("--prefill", action=_ServerAction, nargs="+",
             help="a prefill server and its bootstrap port (default port: "
             f"{DEFAULT_BOOTSTRAP_PORT}); repeat for more servers; at least one is required"),
        flag("--decode", action=_ServerAction, metavar="URL",
             help="a decode server; repeat for more servers (default: none; at least one is "
             "required)"),
        flag("--pd-disaggregation", action="store_true",
             help="accepted for SGLang's command lines; this router is always prefill/decode"),
    ]),
    ("routing and listening", [
        flag("--host", default=_DEFAULT.host, help="address to listen on"),
        flag("--port", type=_listen_port, default=_DEFAULT.port, metavar="PORT",
             help="port to listen on; 0 picks a free one"),
        flag("--policy", choices=POLICIES, default=_DEFAULT.policy,
             help="how a prefill and a decode server are picked for each request: in turn "
             "(a counter for each kind), or the one with the fewest requests in flight through "
             "this router (ties go to the first listed)"),
        flag("--api-key", metavar="KEY",
             help="require 'Authorization: Bearer KEY' on /v1/* (default: none); the header is "
             "passed on to the servers unchanged"),
        flag("--startup-timeout-s", type=_seconds, default=_DEFAULT.startup_timeout_s,
             metavar="S", help="how long to wait at start for every server to answer GET /health"),
        flag("--request-timeout-s", type=_seconds, default=_DEFAULT.request_timeout_s,
             metavar="S",
             help="longest wait for a server's next byte (its answer's head, or the next chunk "
             "of its body)"),
        flag("--max-body-bytes", type=_bytes, default=_DEFAULT.max_body_bytes, metavar="N",
             help="largest request body accepted (413 above it)"),
        flag("--timeout-keep-alive", dest="keep_alive_s", type=_whole_seconds,
             default=_DEFAULT.keep_alive_s, metavar="S",
             help="a client's idle keep-alive connection is closed after this; keep it above "
             "how long clients' pools keep idle connections (httpx 5 s, aiohttp 15 s, Go and "
             "reqwest 90 s), or a request sent as the router closes the connection is lost"),
    ]),
)
# fmt: on


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ROUTER_FLAGS)


def router_settings(args: argparse.Namespace) -> RouterSettings:
    """The settings of parsed router flags; a missing `--prefill` or `--decode` is a
    ValueError (one line)."""
    prefill = tuple(args.prefill or ())
    decode = tuple(args.decode or ())
    if not prefill:
        raise ValueError("at least one --prefill URL [BOOTSTRAP_PORT] is required")
    if not decode:
        raise ValueError("at least one --decode URL is required")
    return RouterSettings(
        prefill=prefill,
        decode=decode,
        host=args.host,
        port=args.port,
        policy=args.policy,
        api_key=args.api_key,
        startup_timeout_s=args.startup_timeout_s,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        keep_alive_s=args.keep_alive_s,
    )
