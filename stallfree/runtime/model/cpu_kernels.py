"""stallfree's own CPU kernels (`csrc/`), built on first use and called as `torch.ops.stallfree.*`.

The kernels are the fast path of the CPU forward: matrix-vector products for every weight
format at a few rows (int8 and int4 on integer dot products over activations quantised to
blocks of 32, bfloat16 and float32 dense), RMSNorm (with the residual add fused in) and
SiLU * up. Each one has a torch reference, today's code, which runs wherever the kernels do not.

Building: the C++ sources are compiled once per (sources, torch version) into torch's extension
cache (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), under torch's own file lock,
so worker processes and tensor-parallel ranks that start together build it once. No
`-march=native`: each instruction-set variant is a translation unit with its own target
attributes, and the one this CPU supports is picked when the library loads.

Environment:
- `STALLFREE_CPU_KERNELS=0` keeps every op on the torch path;
- `STALLFREE_CPU_ISA=auto|avx512|avx2` forces a variant (`auto`, the default, takes the best
  this CPU has: AVX-512 with VNNI and BF16, else AVX2 with FMA). A forced variant the CPU lacks,
  a missing compiler or a failed build leave the torch path on, with one log line saying why;
- `STALLFREE_CPU_AMX=0` keeps dense bfloat16 off the AMX tiles, which the AVX-512 variant
  otherwise uses for a few rows where the CPU reports AMX-TILE and AMX-BF16 and Linux grants
  the process the tile state (never otherwise).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from stallfree.runtime.model.cpu_kernel_fakes import FAKES

logger = logging.getLogger(__name__)

ISAS = ("auto", "avx512", "avx2")
_SOURCES = (
    "ops.cpp",
    "isa_avx512.cpp",
    "isa_avx2.cpp",
    "q8_lanes.cpp",
    "compact_bf16.cpp",
    "isa_amx.cpp",
    "amx_gemm.cpp",
    "bf16_gemm.cpp",
    "attention.cpp",
    "attention_avx512.cpp",
    "attention_avx2.cpp",
    "prefill_attention.cpp",
    "amx_prefill_attention.cpp",
    "layers.cpp",
    "prompt_layers.cpp",
    "rope.cpp",
)
_HEADERS = (
    "vec_exp.h",
    "kernels.h",
    "avx512_tile.h",
    "attention.h",
    "attention_impl.h",
    "amx_tiles.h",
    "blocks16.h",
    "prefill_attention_impl.h",
    "layer_calls.h",
)
_CSRC = Path(__file__).with_name("csrc")

_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "isa": the variant in use, None when off


def _wanted() -> str | None:
    """The variant the environment asks for, or None when the kernels are switched off."""
    if os.environ.get("STALLFREE_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    want = os.environ.get("STALLFREE_CPU_ISA", "auto").strip().lower() or "auto"
    if want == "off":
        return None
    if want not in ISAS:
        raise ValueError(f"STALLFREE_CPU_ISA={want!r}: expected one of {', '.join(ISAS)} or off")
    return want


_OFF = ("0", "off", "false", "no")


def _amx_wanted() -> bool:
    return os.environ.get("STALLFREE_CPU_AMX", "1").strip().lower() not in _OFF


def _library_name() -> str:
    """The extension's name: the sources' hash and torch's version, so an edit or another torch
    builds anew beside the old one instead of loading a stale library."""
    digest = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        digest.update((_CSRC / name).read_bytes())
    digest.update(torch.__version__.encode())
    return f"stallfree_cpu_{digest.hexdigest()[:16]}"


def _ensure_ninja() -> None:
    """torch's extension builder runs `ninja`; the `ninja` wheel puts it beside the package
    rather than always on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


# A build takes seconds to a minute; a lock file older than this was left by a process that
# died while building (torch's lock is a plain file that its waiters poll for ever).
STALE_LOCK_S = 600


def _clear_stale_lock(name: str) -> None:
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("native CPU kernels: removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass


def _build() -> None:
    from torch.utils import cpp_extension

    _ensure_ninja()
    name = _library_name()
    _clear_stale_lock(name)
    cpp_extension.load(
        name=name,
        sources=[str(_CSRC / s) for s in _SOURCES],
        extra_cflags=["-O3", "-fopenmp", "-std=c++17"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _load() -> str | None:
    want = _wanted()
    if want is None:
        return None
    if os.uname().machine not in ("x86_64", "AMD64"):
        logger.info(
            "native CPU kernels: not built for %s; using the torch path", os.uname().machine
        )
        return None
    try:
        if not hasattr(torch.ops.stallfree, "set_isa"):
            _build()
        isa = str(torch.ops.stallfree.set_isa(want))
    except Exception as exc:  # any build or load failure means the torch path
        logger.warning("native CPU kernels unavailable (%s); using the torch path", exc)
        return None
    if not isa:
        logger.warning(
            "native CPU kernels: this CPU has no %s support; using the torch path",
            "AVX2/AVX-512" if want == "auto" else want,
        )
        return None
    _register_fakes()
    tiles = bool(torch.ops.stallfree.set_amx(_amx_wanted()))
    _state["amx"] = "on" if tiles else None
    logger.info("native CPU kernels: %s%s", isa, " with AMX tiles" if tiles else "")
    return isa


_UNDECIDED = "undecided"


def isa() -> str | None:
    """The variant in use ('avx512', 'avx2'), or None on the torch path. Builds and loads the
    library on the first call. Once decided it is a dictionary read with no lock: every native
    call of a decode step asks (a few hundred times a step)."""
    decided = _state.get("isa", _UNDECIDED)
    if decided != _UNDECIDED:
        return decided
    with _lock:
        if "isa" not in _state:
            _state["isa"] = _load()
        return _state["isa"]


def available() -> bool:
    return isa() is not None


def amx() -> bool:
    """Whether dense bfloat16 products of a few rows run on the AMX tiles."""
    isa()
    return _state.get("amx") is not None


@functools.cache
def vendor() -> str:
    """The CPU's vendor as cpuid names it ('GenuineIntel', 'AuthenticAMD'), '' where Linux does
    not say. torch's float32 products are MKL's, whose fast paths run on Intel's CPUs only
    (`native_layers.dense_max_rows`)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_has_amx() -> bool:
    """Whether the CPU (and the OS) give AMX tiles, whether or not the kernels use them
    (`amx()`); asked once, since each prompt layer's attention asks."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def reset() -> None:
    """Forget the choice so the next `isa()` reads the environment again (tests switch
    variants this way; the library itself stays loaded)."""
    with _lock:
        _state.pop("isa", None)
        _state.pop("amx", None)


_fakes_registered = False


def _register_fakes() -> None:
    """Shapes for torch.compile (cpu_kernel_fakes.py): the ops are traced as calls, never into."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True
    for name, fake in FAKES.items():
        torch.library.register_fake("stallfree::" + name)(fake)
