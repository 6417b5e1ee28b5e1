"""A loaded model's weights moved into memory backed by 2 MB pages, where the kernel offers
them (Linux transparent huge pages in `madvise` or `always` mode).

A decode step streams every weight once from memory. With 4 KB pages the hardware
prefetchers stop at each page's end and every 4 KB costs a TLB miss, so two threads read
SmolLM2's projections at about 24 GB/s; from 2 MB pages the same bf16 matrix-vector products
read at about 31 GB/s (benchmarks/bench_gemv.py's shapes, 2 threads). The weights are copied
one storage at a time into one anonymous mapping advised `MADV_HUGEPAGE`, and every tensor
that used a storage is pointed at its copy (`Tensor.set_`), so tied weights stay tied and no
module needs to know. `STALLFREE_HUGE_PAGES=0` turns it off; elsewhere it does nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from pathlib import Path

import torch
from torch import nn

from stallfree.runtime.memory.heap import release_free_heap

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# storages smaller than this stay where they are (norm weights, biases, scales of small layers)
MIN_BYTES = 64 << 10
_ALIGN = 4096
# moved bytes between returns of the C heap's free pages to the system
_TRIM_BYTES = 128 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), or None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def enabled() -> bool:
    if os.environ.get("STALLFREE_HUGE_PAGES", "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    return thp_mode() in ("always", "madvise")


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the modules hold: parameters, buffers, and tensors (or lists of them) kept
    as plain attributes (a fused layer's list of weights)."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        found += [p for p in module.parameters(recurse=False)]
        found += [b for b in module.buffers(recurse=False) if b is not None]
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


# the attribute `stay_in_place` sets on a tensor
_IN_PLACE = "_stallfree_in_place"


def stay_in_place(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` to be left where it is by `move_to_huge_pages` and padded_rows.py (a mapping
    whose untouched pages take no memory, which a copy would fill: compact_only.py's rows that
    do not fit)."""
    setattr(t, _IN_PLACE, True)
    return t


def stays_in_place(t: torch.Tensor) -> bool:
    """Whether `stay_in_place` marked `t`."""
    return bool(getattr(t, _IN_PLACE, False))


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy `model`'s CPU weight storages of `MIN_BYTES` or more into one mapping advised for
    huge pages and point their tensors there. Returns the bytes moved (0 where not enabled)."""
    if not enabled():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for t in module_tensors(model):
        # an opaque oneDNN copy (`--prepack-prompt-weights`) has no storage to move
        if (
            id(t) in seen
            or t.device.type != "cpu"
            or t.is_sparse
            or t.is_mkldnn
            or stays_in_place(t)
        ):
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        if storage.nbytes() < MIN_BYTES:
            continue
        groups.setdefault(storage.data_ptr(), []).append(t)
        storages[storage.data_ptr()] = storage
    if not storages:
        return 0
    order = sorted(storages, key=lambda p: -storages[p].nbytes())
    offsets, total = {}, 0
    for ptr in order:
        offsets[ptr] = total
        total += -(-storages[ptr].nbytes() // _ALIGN) * _ALIGN
    size = -(-total // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena = torch.frombuffer(buf, dtype=torch.uint8)
    base = (-arena.data_ptr()) % HUGE_PAGE  # the first 2 MB boundary inside the mapping
    buf.madvise(mmap.MADV_HUGEPAGE, base, size)
    moved = sum(storages[p].nbytes() for p in order)
    freed = 0
    with torch.no_grad():
        for ptr in order:
            # dropped from the table as it is copied, so each old storage is freed once its
            # tensors point at the copy (the peak is one storage, not the whole model, over)
            old = storages.pop(ptr)
            start = base + offsets[ptr]
            new = arena[start : start + old.nbytes()].untyped_storage()
            # the slice's storage is the whole arena: copy into the bytes at its offset
            arena[start : start + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in groups[ptr]:
                elem = t.element_size()
                offset = start // elem + t.storage_offset()
                t.set_(new, offset, t.size(), t.stride())
            freed += old.nbytes()
            del old
            if freed >= _TRIM_BYTES:
                # storages the C heap held (glibc serves blocks under its mmap threshold, up
                # to 32 MB, from the heap, which keeps them when freed): handed back as the
                # move goes, else every one stays until the move ends and the peak is the
                # weights twice over (the 1B Q8_0 model with its codes re-laid into the
                # lanes: 1955 MB against 1683 with the file's)
                release_free_heap()
                freed = 0
    logger.info("weights: %.0f MB moved to memory advised for 2 MB pages", moved / 2**20)
    return moved
