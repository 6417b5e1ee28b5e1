"""Mirror parity: the checks that each host mirror equals its device tensor and the requests.

The shape checks read host metadata only and always run; the value checks sync the stream, so
they run in tests and debug mode only (`runtime.check_mirrors`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stallfree.runtime.request.req import Req

_I64 = torch.int64

# (name, device tensor, its host mirror)
Mirrors = Sequence[tuple[str, torch.Tensor, torch.Tensor]]


class MirrorParityError(AssertionError):
    """A mirror (or a per-row list) is out of step with its device tensor or the requests."""


def check_shapes(
    op: str, mirrors: Mirrors, reqs: list[Req], rows: Sequence[Sequence[object]]
) -> None:
    """One entry per request in every mirror and per-row list; a mirror is its own tensor."""
    n = len(reqs)
    for name, device, host in mirrors:
        if device is host or host.shape != (n,) or device.shape != (n,):
            raise MirrorParityError(
                f"{op}: {name} {tuple(device.shape)} and its mirror {tuple(host.shape)} "
                f"for {n} rows" + (" are one tensor" if device is host else "")
            )
    if any(len(col) != n for col in rows):
        raise MirrorParityError(
            f"{op}: per-row lists of lengths {[len(c) for c in rows]} for {n} rows"
        )


def check_parity(
    op: str, mirrors: Mirrors, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int]
) -> None:
    """Each mirror is an int64 host tensor, not its device tensor and not sharing its memory,
    equal to the device tensor (read here: the caller synced the stream); prefix + extend
    lengths equal `seq_lens`; the slots are the requests' own. A request finished and released
    between steps keeps its row until the next filter, so its slot is not compared."""
    host_of = {}
    for name, device, host in mirrors:
        mirror = f"{op}: {name}_cpu"
        host_of[name] = host
        if host.dtype != _I64 or host.device.type != "cpu":
            raise MirrorParityError(f"{mirror} is {host.dtype} on {host.device}")
        if host is device or (
            host.numel()
            and host.untyped_storage().data_ptr() == device.untyped_storage().data_ptr()
        ):
            raise MirrorParityError(f"{mirror} is the device tensor, not a mirror of it")
        values = device.cpu()
        if not host.equal(values):
            raise MirrorParityError(f"{mirror} mirror {host.tolist()} != device {values.tolist()}")
    ends = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    if ends != host_of["seq_lens"].tolist():
        raise MirrorParityError(
            f"{op}: per-row lists out of step with the rows: prefix + extend {ends} != "
            f"seq_lens {host_of['seq_lens'].tolist()}"
        )
    slots = host_of["req_pool_indices"].tolist()
    if len(slots) != len(reqs):
        raise MirrorParityError(f"{op}: {len(slots)} mirror rows for {len(reqs)} reqs")
    for i, (req, slot) in enumerate(zip(reqs, slots, strict=True)):
        if req.req_pool_idx is None and req.finished:
            continue  # released between steps; filtered out before the next launch
        if req.req_pool_idx != slot:
            raise MirrorParityError(
                f"{op}: mirror out of step with reqs: row {i} ({req.rid}) has slot "
                f"{req.req_pool_idx}, the mirror says {slot}"
            )


def check_launchable(reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor) -> None:
    """Debug: a batch about to launch has no released row and fits its step's tensors."""
    released = [r.rid for r in reqs if r.req_pool_idx is None]
    if released:
        raise MirrorParityError(f"launch: rows {released} hold no request slot")
    n_tokens = sum(extend_lens)
    if out_cache_loc.shape != (n_tokens,):
        raise MirrorParityError(
            f"launch: out_cache_loc {tuple(out_cache_loc.shape)} for {n_tokens} tokens "
            "(was the batch filtered or merged and not prepared again?)"
        )
