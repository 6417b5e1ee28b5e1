"""Dense float32 linears on the native matrix-vector kernel: a few rows everywhere, a decode
step's rows further on a CPU that is not Intel's (256 on the AVX-512 variant, 32 on AVX2),
where torch's float32 product is MKL's slow path. Past them a prompt multiplies on torch
(transformers' sums, bit for bit) on Intel, on oneDNN elsewhere, where the model also stacks
q/k/v and gate/up. The tests set the vendor both ways, so each path runs on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stallfree.runtime.model import cpu_kernels, native_layers
from stallfree.runtime.model.compile import throwaway_batch
from stallfree.runtime.model.decode_rows import decode_rows
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model
from tests.hf_models import make_llama
from tests.model.native_util import OpCalls

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels unavailable here"
)


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    with torch.no_grad():
        return float((out.double() - want).norm() / want.norm())


@pytest.fixture
def vendor(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set the CPU vendor `native_layers.dense_max_rows` reads."""

    def set_vendor(name: str) -> None:
        monkeypatch.setattr(cpu_kernels, "vendor", lambda: name)

    return set_vendor


def test_the_vendor_is_what_linux_reports() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo here")
    named = [line for line in cpuinfo.read_text().splitlines() if line.startswith("vendor_id")]
    want = named[0].split(":", 1)[1].strip() if named else ""
    assert cpu_kernels.vendor() == want


@pytest.mark.parametrize("name", ["AuthenticAMD", "HygonGenuine", "GenuineIntel", ""])
def test_a_decode_steps_float32_rows_go_further_only_off_intel(vendor, name: str) -> None:  # type: ignore[no-untyped-def]
    """Off Intel a decode step's float32 rows take the kernel further (per variant); on
    Intel (and a CPU Linux does not name) they keep the few rows bfloat16 has without the decode
    raise; a prompt's rows keep them everywhere; bfloat16's limit is not touched."""
    vendor(name)
    few = native_layers.dense_max_rows(torch.float32)
    bf16 = native_layers.dense_max_rows(torch.bfloat16)
    assert few in (native_layers.DENSE_MAX_ROWS, native_layers.AMX_MAX_ROWS)
    with decode_rows():
        in_decode = native_layers.dense_max_rows(torch.float32)
        bf16_decode = native_layers.dense_max_rows(torch.bfloat16)
    off_intel = name not in ("GenuineIntel", "")
    further = {"avx512": 256, "avx2": 32}[cpu_kernels.isa() or ""]
    assert in_decode == (further if off_intel else few)
    vendor("GenuineIntel")
    assert native_layers.dense_max_rows(torch.bfloat16) == bf16
    with decode_rows():
        assert native_layers.dense_max_rows(torch.bfloat16) == bf16_decode


@pytest.mark.parametrize("name", ["AuthenticAMD", "GenuineIntel"])
def test_a_float32_layer_takes_the_kernel_up_to_its_rows(vendor, name: str) -> None:  # type: ignore[no-untyped-def]
    """A float32 nn.Linear is switched to NativeLinear; its calls up to `dense_max_rows` go to
    the kernel (close to the float64 product), past them to F.linear on Intel (its bits
    exactly), oneDNN elsewhere (`float32_product`)."""
    vendor(name)
    torch.manual_seed(0)
    layer = torch.nn.Linear(100, 72)  # widths off the vector length
    assert native_layers.use_native_linears(layer) == 1
    assert isinstance(layer, native_layers.NativeLinear)
    for decode in (False, True):
        with decode_rows(decode):
            most = native_layers.dense_max_rows(torch.float32)
            for rows in (1, 3, most, most + 1):
                x = torch.randn(rows, 100)
                with torch.no_grad(), OpCalls() as ops:
                    out = layer(x)
                native = rows <= most
                assert ("stallfree.linear" in ops.calls) == native, (decode, rows)
                want = x.double() @ layer.weight.double().T + layer.bias.double()
                assert _rel(out, want) < 1e-6
                if not native:  # F.linear's bits on Intel, oneDNN's elsewhere
                    product = native_layers.float32_product(x, layer.weight, layer.bias)
                    assert torch.equal(out, product)
                    intel = torch.equal(out, F.linear(x, layer.weight, layer.bias))
                    assert intel or name != "GenuineIntel"


@pytest.mark.parametrize("name", ["AuthenticAMD", "GenuineIntel"])
def test_a_tied_float32_head_takes_the_kernel_at_a_few_rows(vendor, name: str) -> None:  # type: ignore[no-untyped-def]
    """`native_layers.linear` (the tied output head) in float32: the kernel at a few rows, past
    them F.linear's bits on Intel and oneDNN's elsewhere (a prefill batch's last rows)."""
    vendor(name)
    torch.manual_seed(1)
    weight = torch.randn(300, 64)
    most = native_layers.dense_max_rows(torch.float32)
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 64)
        with OpCalls() as ops:
            out = native_layers.linear(x, weight)
        assert ("stallfree.linear" in ops.calls) == (rows <= most)
        onednn = "mkldnn._linear_pointwise" in ops.calls
        assert onednn == (rows > most and name != "GenuineIntel")
        if rows > most and name == "GenuineIntel":
            assert torch.equal(out, F.linear(x, weight))
        assert _rel(out, x.double() @ weight.double().T) < 1e-6


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("f32"), num_hidden_layers=2)


def _decode_step(path: Path, rows: int) -> tuple[torch.Tensor, list[str]]:
    loaded = load_model(str(path), "float32", torch.device("cpu"), 0, quantization="none")
    fb = throwaway_batch(loaded, ForwardMode.DECODE, [5 + i for i in range(rows)], 1)
    torch.manual_seed(0)
    for k, v in zip(fb.kv_cache.k_buffers, fb.kv_cache.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    fb.input_ids = torch.randint(0, loaded.arch.vocab_size, (rows,))
    with OpCalls() as ops:
        logits = loaded.model(fb)
    return logits, ops.calls


@pytest.mark.parametrize("loop", ["1", "0"])
def test_a_float32_decode_step_of_20_rows_off_intel_runs_every_product_on_the_kernel(
    llama_dir: Path, vendor, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A float32 decode step of 20 rows (past the few rows) off Intel: the stacked q/k/v, o,
    the stacked gate/up, down and the head on the kernel, no aten matrix product, in the C++
    loop and in Python alike; on Intel (projections apart) the same step multiplies on torch.
    The logits agree to float32's rounding and pick the same tokens."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", loop)
    vendor("AuthenticAMD")
    amd, amd_calls = _decode_step(llama_dir, 20)
    vendor("GenuineIntel")
    intel, intel_calls = _decode_step(llama_dir, 20)
    products = ("aten.mm", "aten.addmm", "aten.linear", "aten.matmul")
    assert not any(name in amd_calls for name in products)
    if loop == "1":
        assert "stallfree.decode_layers" in amd_calls
    else:
        layers = 2
        assert "stallfree.linear_group" not in amd_calls
        # q/k/v, o, gate/up, down; the head
        assert amd_calls.count("stallfree.linear") == 4 * layers + 1
    assert any(name in intel_calls for name in products)
    assert torch.allclose(amd, intel, rtol=1e-4, atol=1e-4)
    assert torch.equal(amd.argmax(-1), intel.argmax(-1))


def _prompt(path: Path, rows: int) -> tuple[torch.Tensor, list[str]]:
    loaded = load_model(str(path), "float32", torch.device("cpu"), 0, quantization="none")
    fb = throwaway_batch(loaded, ForwardMode.EXTEND, [rows], rows)
    fb.input_ids = torch.arange(rows) % loaded.arch.vocab_size
    with OpCalls() as ops:
        logits = loaded.model(fb)
    return logits, ops.calls


def test_a_float32_prompt_off_intel_multiplies_on_onednn(
    llama_dir: Path, vendor, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A float32 prompt past the kernel's rows: off Intel each product (the stacked q/k/v, o,
    the stacked gate/up, down) is oneDNN's on the weight as it is; on Intel torch's F.linear and
    mm over the projections apart (transformers' sums). The two agree to float32's rounding."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "0")  # the Python loop: its calls are visible
    vendor("AuthenticAMD")
    amd, amd_calls = _prompt(llama_dir, 40)
    vendor("GenuineIntel")
    intel, intel_calls = _prompt(llama_dir, 40)
    layers = 2
    assert amd_calls.count("mkldnn._linear_pointwise") == 4 * layers
    assert not any(name in amd_calls for name in ("aten.mm", "aten.addmm"))
    assert "mkldnn._linear_pointwise" not in intel_calls
    assert torch.allclose(amd, intel, rtol=1e-4, atol=1e-4)
    assert torch.equal(amd.argmax(-1), intel.argmax(-1))


@pytest.mark.parametrize(
    ("name", "kernels", "stacked"),
    [("AuthenticAMD", True, True), ("GenuineIntel", True, False), ("AuthenticAMD", False, False)],
)
def test_a_float32_model_stacks_its_projections_only_off_intel_with_the_kernels(
    llama_dir: Path, vendor, name: str, kernels: bool, stacked: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A dense float32 model keeps q/k/v and gate/up apart (transformers' sums, bit for bit)
    unless its products leave those sums anyway: off Intel with the kernels built (decode rows
    on the native kernel, prompts on oneDNN), where one product over the stacked rows is the
    cheaper. Without the kernels F.linear's MKL keeps transformers' bits, so it stays apart."""
    vendor(name)
    monkeypatch.setattr(cpu_kernels, "available", lambda: kernels)
    loaded = load_model(str(llama_dir), "float32", torch.device("cpu"), 0, quantization="none")
    for layer in loaded.model.model.layers:
        assert (layer.self_attn.qkv_proj is not None) == stacked
        assert (getattr(layer.mlp, "gate_up_proj", None) is not None) == stacked
        assert hasattr(layer.self_attn, "q_proj") != stacked
