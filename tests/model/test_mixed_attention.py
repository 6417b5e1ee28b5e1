"""A mixed step's decode rows (an extend step's last rows of one token each, over their cached
keys) take the native decode op in one call per layer, with the same logits as the prompt row
run as an extend step and the decode rows as a decode step over the same cache; the prompt rows
keep their own attention calls."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.model import attention, cpu_kernels
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.loader import LoadedModel, load_model
from tests.hf_models import make_llama

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels unavailable here"
)

LAYERS = 3
WIDTH = 32  # slots per request row


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _batch(
    loaded: LoadedModel, kv: KVCache, mode: ForwardMode, rows: list[int], lens: list[int],
    new: list[int],
) -> ForwardBatch:  # fmt: skip
    """Requests in pool rows `rows`, `new[i]` tokens each, length `lens[i]` after the step;
    each pool row's slots are contiguous."""
    req_to_token = torch.arange(1, 1 + 8 * WIDTH, dtype=torch.int64).view(8, WIDTH)
    ids: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    for row, n, m in zip(rows, lens, new, strict=True):
        ids += [(7 * row + p) % 100 + 3 for p in range(n - m, n)]
        positions += range(n - m, n)
        locs += req_to_token[row, n - m : n].tolist()
    rows_t = torch.tensor(rows)
    seq_lens = torch.tensor(lens)
    return ForwardBatch(
        mode=mode,
        batch_size=len(rows),
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(locs),
        req_pool_indices=rows_t,
        seq_lens=seq_lens,
        req_pool_indices_cpu=rows_t.clone(),
        seq_lens_cpu=seq_lens.clone(),
        extend_lens_cpu=list(new),
        prefix_lens_cpu=[n - m for n, m in zip(lens, new, strict=True)],
        req_to_token=req_to_token,
        kv_cache=kv,
    )


def _cache(loaded: LoadedModel) -> KVCache:
    kv = KVCache(loaded.kv_cache_shape(), 8 * WIDTH + 1, loaded.dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for k, v in zip(kv.k_buffers, kv.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    return kv


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("mixed"), num_hidden_layers=LAYERS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompts", [[(0, 6)], [(0, 6), (4, 11)], []])
def test_decode_rows_of_a_mixed_step_take_one_native_call(
    llama_dir: Path, dtype: str, prompts: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # PagedAttention's own calls, counted as Python dispatches them: the prompt's layer loop in
    # C++, which would take a float32 step of more than 16 rows, is off here (its tests cover
    # a mixed step's decode rows inside it)
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "0")
    loaded = load_model(str(llama_dir), dtype, torch.device("cpu"), 0, quantization="none")
    decode_rows, decode_lens = [1, 2, 3], [6, 10, 4]  # prefixes 5, 9 and 3 in the cache
    p_rows, p_lens = [r for r, _ in prompts], [n for _, n in prompts]
    n_p = len(prompts)

    kv = _cache(loaded)
    mixed = _batch(
        loaded, kv, ForwardMode.EXTEND, p_rows + decode_rows, p_lens + decode_lens,
        [*p_lens, 1, 1, 1],
    )  # fmt: skip
    with _Count() as counter:
        got = loaded.model(mixed)

    kv = _cache(loaded)  # the same contents again
    parts = []
    if prompts:
        parts.append(loaded.model(_batch(loaded, kv, ForwardMode.EXTEND, p_rows, p_lens, p_lens)))
    parts.append(loaded.model(_batch(loaded, kv, ForwardMode.DECODE, decode_rows, decode_lens,
                                     [1, 1, 1])))  # fmt: skip
    want = torch.cat(parts)

    assert got.shape == want.shape == (n_p + 3, loaded.arch.vocab_size)
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    # one native call per layer takes the three decode rows; each prompt row its own attention
    assert counter.calls["stallfree.decode_attention"] == LAYERS
    # (a float32 prompt's on the native prompt kernel; a bfloat16 one's where
    # attention.bf16_prompt_native sends it: the tiles where they are in use and take the
    # head dim, the vector path on a CPU without tiles, else SDPA)
    sdpa = sum(n for name, n in counter.calls.items() if "scaled_dot_product" in name)
    native = counter.calls["stallfree.prefill_attention"]
    on_native = dtype == "float32" or attention.bf16_prompt_native(loaded.arch.head_dim)
    assert (native, sdpa) == ((n_p * LAYERS, 0) if on_native else (0, n_p * LAYERS))


def test_one_trailing_decode_row_stays_on_the_extend_path(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir), "float32", torch.device("cpu"), 0, quantization="none")
    kv = _cache(loaded)
    fb = _batch(loaded, kv, ForwardMode.EXTEND, [0, 1], [6, 9], [6, 1])
    with _Count() as counter:
        loaded.model(fb)
    assert counter.calls["stallfree.decode_attention"] == 0
