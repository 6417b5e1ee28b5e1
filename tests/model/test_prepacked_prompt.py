"""`--prepack-prompt-weights` (`model.prepack_prompt_weights`): each dense bfloat16 projection
keeps a second copy of its weight in oneDNN's blocked order, and a prompt of
`PREPACKED_MIN_ROWS` rows or more multiplies that copy, with F.linear's bits; fewer rows keep
the native kernels; the output head keeps no copy; the opaque copy is left where the weights
move to huge pages; the flag reaches the loader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.memory import huge_pages
from stallfree.runtime.model import cpu_kernels, native_layers

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="this torch's oneDNN has no bfloat16 products on this CPU: nothing is prepacked",
)

ROWS = native_layers.PREPACKED_MIN_ROWS


@pytest.fixture(autouse=True)
def as_with_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is made where the CPU has the AMX tiles, whose decode kernels take at most
    AMX_DECODE_MAX_ROWS rows (AVX512-BF16 without them, whose kernel takes up to
    AVX512_BF16_MAX_ROWS, keeps none: its prompt product is the faster); the AVX2 variant
    (`STALLFREE_CPU_ISA=avx2`) takes every bfloat16 row count itself and would never reach the
    copy. The cap keeps these tests' row counts past the native kernels on every variant."""
    real = native_layers.dense_max_rows
    cap = native_layers.AMX_DECODE_MAX_ROWS
    monkeypatch.setattr(native_layers, "dense_max_rows", lambda dtype=None: min(real(dtype), cap))


def bf16_linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    return layer


@pytest.fixture
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows multiplied by each call of the prepacked product."""
    calls: list[int] = []
    real = native_layers.packed_linear

    def counted(x: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None):  # type: ignore[no-untyped-def]
        calls.append(x.numel() // x.shape[-1])
        return real(x, packed, bias)

    monkeypatch.setattr(native_layers, "packed_linear", counted)
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(ROWS,), (ROWS + 77,), (2, ROWS // 2 + 3)])
def test_a_prompt_multiplies_the_prepacked_copy_with_f_linears_bits(
    packed_calls: list[int], bias: bool, shape: tuple[int, ...]
) -> None:
    ref = bf16_linear(96, 160, bias)
    layer = native_layers.NativeLinear.adopt(bf16_linear(96, 160, bias), prepack=True)
    assert layer.weight_prepacked is not None and layer.weight_prepacked.is_mkldnn
    x = torch.randn(*shape, 160).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        want = F.linear(x, ref.weight, ref.bias)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    assert packed_calls == [x.numel() // 160]


def test_fewer_rows_keep_the_native_path(packed_calls: list[int]) -> None:
    layer = native_layers.NativeLinear.adopt(bf16_linear(64, 128, False), prepack=True)
    for rows in (1, 8, ROWS - 1):
        with torch.inference_mode():
            layer(torch.randn(rows, 128).to(torch.bfloat16))
    assert packed_calls == []


def test_without_prepack_no_copy_is_kept(packed_calls: list[int]) -> None:
    layer = native_layers.NativeLinear.adopt(bf16_linear(64, 128, False))
    assert layer.weight_prepacked is None
    with torch.inference_mode():
        layer(torch.randn(ROWS * 2, 128).to(torch.bfloat16))
    assert packed_calls == []


def test_a_stacked_gate_up_on_the_copy_takes_silu_mul_after_it(packed_calls: list[int]) -> None:
    """The tiles' fused SiLU is not used for a prompt that takes the copy: the product, then
    silu_mul, so the bits are those of silu_mul over F.linear."""
    ref = bf16_linear(128, 96, False)
    layer = native_layers.NativeLinear.adopt(bf16_linear(128, 96, False), prepack=True)
    x = torch.randn(ROWS + 5, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert layer.silu_product(x) is None
        got = native_layers.gate_up_silu(layer, x)
        want = native_layers.silu_mul(F.linear(x, ref.weight))
    assert torch.equal(got, want)
    assert packed_calls == [ROWS + 5]


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = bf16_linear(64, 64, False)
        self.lm_head = bf16_linear(256, 64, False, seed=1)


def test_every_projection_but_the_output_head_is_prepacked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not cpu_kernels.available():
        pytest.skip("the native kernels are off (STALLFREE_CPU_KERNELS=0 or no compiler)")
    monkeypatch.setattr(cpu_kernels, "amx", lambda: True)
    model = _Head()
    assert native_layers.use_native_linears(model, prepack=True) == 2
    assert isinstance(model.proj, native_layers.NativeLinear)
    assert isinstance(model.lm_head, native_layers.NativeLinear)
    assert model.proj.weight_prepacked is not None
    assert model.lm_head.weight_prepacked is None
    # without the AMX tiles none is kept: the AVX-512 variant's prompt product (csrc/
    # bf16_gemm.cpp) is ahead of oneDNN on such a copy, and the AVX2 variant's matrix-vector
    # kernel takes every bfloat16 row count
    monkeypatch.setattr(cpu_kernels, "amx", lambda: False)
    for isa in ("avx512", "avx2"):
        monkeypatch.setattr(cpu_kernels, "isa", lambda isa=isa: isa)
        plain = _Head()
        native_layers.use_native_linears(plain, prepack=True)
        assert plain.proj.weight_prepacked is None, isa


def test_huge_pages_leave_the_opaque_copy_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """An opaque oneDNN tensor has no storage: moving the weights to huge pages skips it (it
    raised before) and still moves the row-major weight the decode kernels read."""
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)
    model = nn.Sequential(native_layers.NativeLinear.adopt(bf16_linear(64, 128, False), True))
    before = model[0].weight.data_ptr()
    packed = model[0].weight_prepacked
    assert huge_pages.move_to_huge_pages(model) >= 64 * 128 * 2
    assert model[0].weight.data_ptr() != before
    assert model[0].weight_prepacked is packed
    x = torch.randn(ROWS, 128).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(model(x), F.linear(x, model[0].weight))


def test_the_flag_sets_the_model_setting() -> None:
    from stallfree.cli import build_parser
    from stallfree.entrypoints.cli import config_from_args

    parser = build_parser()
    on = config_from_args(parser.parse_args(["serve", "--model", "x", "--prepack-prompt-weights"]))
    off = config_from_args(parser.parse_args(["serve", "--model", "x"]))
    assert on.model.prepack_prompt_weights is True
    assert off.model.prepack_prompt_weights is False


def test_the_loader_prepacks_a_native_family_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_kernels.available():
        pytest.skip("the native kernels are off (STALLFREE_CPU_KERNELS=0 or no compiler)")
    from stallfree.runtime.model.loader import load_model

    monkeypatch.setattr(cpu_kernels, "amx", lambda: True)
    for prepack in (False, True):
        loaded = load_model(
            "tiny", "bfloat16", torch.device("cpu"), 0, prepack_prompt_weights=prepack
        )
        layers = [
            (name, m)
            for name, m in loaded.model.named_modules()
            if isinstance(m, native_layers.NativeLinear)
        ]
        assert layers
        packed = {name for name, m in layers if m.weight_prepacked is not None}
        expected = (
            {name for name, _ in layers if not name.endswith("lm_head")} if prepack else set()
        )
        assert packed == expected


def test_worker_processes_are_told_to_prepack() -> None:
    """A model in worker processes (or tensor-parallel ranks) loads with the same setting."""
    from stallfree.runtime.execution.worker import worker_spec
    from tests.engine_util import engine_config

    for prepack in (True, False):
        cfg = engine_config("tiny", model={"prepack_prompt_weights": prepack})
        assert worker_spec(cfg, 64, 128).prepack_prompt_weights is prepack
