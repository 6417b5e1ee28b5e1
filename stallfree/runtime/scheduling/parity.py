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
    op: str,
    mirrors: Mirrors,
    reqs: list[Req],
    rows: Sequence[Sequence[object]],
    committed: torch.Tensor,
) -> None:
    """One entry per request in every mirror and per-row list; a mirror is its own tensor."""
    n = len(reqs)
    for name, device, host in mirrors:
        if device is host or host.shape != (n,) or device.shape != (n,):
            raise MirrorParityError(
                f"{op}: {name} {tuple(device.shape)} and its mirror {tuple(host.shape)} "
                f"for {n} rows" + (" are one tensor" if device is host else "")
            )
    if committed.shape != (n,):
        raise MirrorParityError(
            f"{op}: committed length mirror {tuple(committed.shape)} for {n} rows (an op left "
            "the speculative state behind)"
        )
    if any(len(col) != n for col in rows):
        raise MirrorParityError(
            f"{op}: per-row lists of lengths {[len(c) for c in rows]} for {n} rows"
        )


def check_parity(
    op: str,
    mirrors: Mirrors,
    reqs: list[Req],
    prefix_lens: list[int],
    extend_lens: list[int],
    committed: torch.Tensor,
) -> None:
    """Each mirror is an int64 host tensor, not its device tensor and not sharing its memory,
    equal to the device tensor (read here: the caller synced the stream); prefix + extend
    lengths equal `seq_lens`; the slots are the requests' own. A request finished and released
    between steps keeps its row until the next filter, so its slot is not compared.

    Speculative decoding: `seq_lens_cpu` is each row's upper bound (`num_computed_tokens`) and
    `committed` its exact length as of the last processed batch (the bound less the request's
    `spec_window`). While a verify step is in flight, `committed <= device <= bound`; once it
    is processed (window 0), the device equals the bound exactly."""
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
        if name == "seq_lens":
            _check_lengths(mirror, host, values, committed, reqs)
        elif not host.equal(values):
            raise MirrorParityError(f"{mirror} mirror {host.tolist()} != device {values.tolist()}")
    ends = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    bound, low = host_of["seq_lens"].tolist(), committed.tolist()
    for i, (end, ub, lo) in enumerate(zip(ends, bound, low, strict=True)):
        if end != ub and not (lo <= end <= ub):
            raise MirrorParityError(
                f"{op}: per-row lists out of step with the rows: prefix + extend {ends} != "
                f"seq_lens {bound} (row {i}, committed {lo})"
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


def _check_lengths(
    mirror: str, bound: torch.Tensor, device: torch.Tensor, committed: torch.Tensor, reqs: list[Req]
) -> None:
    """The length mirror: equal to the device where nothing is in flight speculatively, else
    `committed <= device <= bound`, with `committed` the bound less the request's window."""
    if bound.equal(device) and committed.equal(bound):
        return
    for i, req in enumerate(reqs):
        ub, dev, lo = int(bound[i]), int(device[i]), int(committed[i])
        live = not (req.finished and req.req_pool_idx is None)
        if live and lo != ub - req.spec_window:
            raise MirrorParityError(
                f"{mirror}: committed mirror {committed.tolist()} is not the bound less the "
                f"window ({req.rid}: bound {ub}, window {req.spec_window}, committed {lo})"
            )
        if lo == ub and dev != ub:
            raise MirrorParityError(f"{mirror} mirror {bound.tolist()} != device {device.tolist()}")
        if not lo <= dev <= ub:
            raise MirrorParityError(
                f"{mirror}: device {device.tolist()} outside committed {committed.tolist()} .. "
                f"bound {bound.tolist()} (row {i}, {req.rid})"
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
