"""Zero-filled host buffers whose pages are committed on first write, as the KV pool needs.

`torch.zeros` on the CPU writes every byte, so a KV pool sized for 32k tokens is resident (and
counted in the process's RSS) from the start although most of it is never used. An anonymous
private mapping reads as zeros by the kernel's guarantee, and a page becomes resident only when
something writes it: the pool costs what the served contexts use, as llama.cpp's does. On other
devices, and for small buffers, this is `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch

# Below this a mapping saves nothing worth a system call (and a tensor per mapping).
MIN_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on the CPU its pages are resident only once written."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to the mapping for as long as the tensor lives
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)
