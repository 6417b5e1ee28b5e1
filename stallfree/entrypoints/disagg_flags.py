"""Disaggregation's rows of the flag table on `serve`, in SGLang's spelling
(`--disaggregation-mode prefill`, `--disaggregation-bootstrap-port`,
`--disaggregation-transfer-backend`) and vLLM's (`--kv-transfer-config '{"kv_connector": ...,
"kv_role": "kv_producer"}'`), all filling the one `disaggregation` section through `SectionFlag`.
Two flags that set one setting to different values are refused as a usage error."""

from __future__ import annotations

import argparse
import json
from typing import Any

from stallfree.config.disagg import parse_endpoint
from stallfree.entrypoints.flags import Flag, SectionFlag, Table, flag

DISAGG_DEST = "disaggregation_settings"

_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
# vLLM's connectors that mean a transport here; the others move KV in ways not built here
_CONNECTORS = {
    "StallfreeConnector": "auto",
    "TorchDistributedConnector": "auto",
    "P2pNcclConnector": "nccl",
    "GlooConnector": "gloo",
}
# vLLM's kv_connector_extra_config keys that are settings here, under the same names
_EXTRA_KEYS = ("bootstrap_timeout_s", "transfer_timeout_s", "heartbeat_interval_s")
# keys of vLLM's KVTransferConfig that mean nothing here (one connector per server pair)
_IGNORED = ("kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_buffer_size", "engine_id")
_VLLM_KEYS = {"kv_role", "kv_connector", "kv_ip", "kv_port", "kv_connector_extra_config", *_IGNORED}


def _check(given: dict[str, Any], flag_name: str, entry: dict[str, Any]) -> None:
    """A setting another flag (or this one, given before) set to a different value is an
    error."""
    have = {key: (name, value) for name, e in given.items() for key, value in e["sets"].items()}
    for key, value in entry["sets"].items():
        if key in have and have[key][1] != value:
            other, was = have[key]
            raise argparse.ArgumentError(
                None,
                f"{flag_name} sets disaggregation.{key}={value!r} but {other} set it to {was!r}",
            )


def kv_transfer_settings(text: str) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` JSON as `disaggregation` settings."""
    try:
        cfg = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kv-transfer-config is not JSON: {text!r}") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError("--kv-transfer-config must be a JSON object")
    role = cfg.get("kv_role")
    if role == "kv_both":
        raise argparse.ArgumentTypeError(
            "kv_role kv_both: a stallfree server is either prefill (kv_producer) or decode "
            "(kv_consumer); colocated serving needs no connector"
        )
    if role not in _ROLES:
        raise argparse.ArgumentTypeError(
            f"kv_role must be kv_producer or kv_consumer, not {role!r}"
        )
    out: dict[str, Any] = {"mode": _ROLES[role], **_connector(cfg)}
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError("kv_connector_extra_config must be a JSON object")
    for key, value in extra.items():
        if key not in _EXTRA_KEYS:
            raise argparse.ArgumentTypeError(
                f"kv_connector_extra_config key {key!r} is not known here "
                f"(known: {', '.join(_EXTRA_KEYS)})"
            )
        out[key] = value
    unknown = set(cfg) - _VLLM_KEYS
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--kv-transfer-config keys not known here: {', '.join(sorted(unknown))}"
        )
    return out


def _connector(cfg: dict[str, Any]) -> dict[str, Any]:
    """The transport and the bootstrap endpoint a `--kv-transfer-config` names."""
    out: dict[str, Any] = {}
    connector = cfg.get("kv_connector", "StallfreeConnector")
    if connector not in _CONNECTORS:
        raise argparse.ArgumentTypeError(
            f"kv_connector {connector!r} is not built: stallfree moves KV over torch.distributed "
            f"({', '.join(_CONNECTORS)})"
        )
    if _CONNECTORS[connector] != "auto":
        out["transfer_backend"] = _CONNECTORS[connector]
    if "kv_ip" in cfg:
        out["bootstrap_host"] = str(cfg["kv_ip"])
    if "kv_port" in cfg:
        port = cfg["kv_port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"kv_port must be a port number, not {port!r}")
        out["bootstrap_port"] = port
    return out


def prefill_hosts(text: str) -> list[str]:
    """`host:port,host:port` as the list `disaggregation.prefill_hosts` takes."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    for entry in entries:
        try:
            parse_endpoint(entry)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def _setting(name: str, key: str, *aliases: str, **kw: Any) -> Flag:
    return flag(
        name,
        *aliases,
        action=SectionFlag,
        dest=DISAGG_DEST,
        check=_check,
        to=lambda v: {key: v},
        sets=f"disaggregation.{key}",
        **kw,
    )


# fmt: off
DISAGGREGATION_FLAGS: Table = (("prefill/decode disaggregation (docs/disaggregation.md)", [
    _setting("--disaggregation-mode", "mode", choices=["null", "prefill", "decode"],
             help="this server's role"),
    _setting("--disaggregation-transfer-backend", "transfer_backend",
             choices=["auto", "gloo", "nccl"],
             help="how KV moves: torch.distributed over gloo or NCCL"),
    _setting("--disaggregation-bootstrap-port", "bootstrap_port", type=int, metavar="PORT",
             help="prefill: the bootstrap endpoint's port"),
    _setting("--disaggregation-bootstrap-host", "bootstrap_host", metavar="HOST",
             help="prefill: the address the bootstrap endpoint binds"),
    _setting("--disagg-prefill-hosts", "prefill_hosts", "--disaggregation-prefill-hosts",
             type=prefill_hosts, metavar="HOST:PORT,...",
             help="decode: the prefill bootstrap endpoints it may pair with (requests naming "
             "any other are refused); unset, prefill servers on loopback addresses only"),
    _setting("--disagg-secret", "secret", "--disaggregation-secret", metavar="SECRET",
             help="the shared secret of the prefill's bootstrap endpoint (both sides); prefer "
             "STALLFREE_DISAGGREGATION__SECRET, which keeps it off the command line"),
    _setting("--disagg-pair-timeout", "pair_timeout_s", type=float, metavar="SECONDS",
             help="prefill: how long a pair waits for its decode side to join"),
    *(_setting(f"--disaggregation-{key.split('_')[0]}-timeout", key, type=float,
               metavar="SECONDS", help=f"a room's {what}")
      for key, what in (("bootstrap_timeout_s", "pairing deadline"),
                        ("transfer_timeout_s", "transfer deadline"))),
    flag("--kv-transfer-config", action=SectionFlag, dest=DISAGG_DEST, check=_check,
         to=kv_transfer_settings, metavar="JSON",
         help="vLLM's spelling: kv_role kv_producer (prefill) or kv_consumer (decode), "
         "kv_connector, kv_ip and kv_port (the bootstrap endpoint) (default: none; sets "
         "disaggregation.mode and the settings it names)"),
]),)
# fmt: on


def disaggregation_settings(args: argparse.Namespace) -> dict[str, Any]:
    given = getattr(args, DISAGG_DEST, None) or {}
    return {key: value for entry in given.values() for key, value in entry["sets"].items()}
