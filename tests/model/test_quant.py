"""Weight-only quantization: GGUF blocks read exactly, the int8 / int4 layers on both their
paths (the integer kernel up to `kernel_max_rows` rows, the dequantised matmul above), models
quantized at load and GGUF files kept packed, and the setting's plumbing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.runtime.model import ModelLoadError, cpu_kernels, load_model, native_layers, quant
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import resolve_quantization
from tests.engine_util import engine_config, random_prompts
from tests.hf_models import make_llama
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness

gguf = pytest.importorskip("gguf", reason="pip install 'stallfree[gguf]'")

from stallfree.runtime.model.gguf_blocks import decode_blocks  # noqa: E402
from tests.model.test_gguf import write_gguf  # noqa: E402


def _random_weight(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_as_the_gguf_library_dequantises(kind: str) -> None:
    w = _random_weight(48, 256)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(w.shape)
    got = decode_blocks(raw, kind, *w.shape).dequantize().numpy()
    if kind == "Q8_0":
        # the file's own block scales and codes: exactly its values
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kind", "header"), [("Q4_0", 2), ("Q4_1", 4)])
def test_q4_0_and_q4_1_codes_are_the_files_nibble_pairs_as_stored(kind: str, header: int) -> None:
    """A Q4_0 / Q4_1 block's 16 code bytes already hold element j low and j + 16 high, the int4
    layers' own pairs: the load copies them (no unpacking to a byte per code and packing again),
    and an int4 layer built from the weight keeps those bytes."""
    w = _random_weight(32, 128, seed=3)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    size = header + 16
    stored = torch.from_numpy(raw.reshape(-1, size)[:, header:].copy()).view(32, 4, 16)
    got = decode_blocks(raw, kind, *w.shape)
    assert torch.equal(got.pairs, stored)
    assert torch.equal(quant.pack_pairs(got.q), stored)
    layer = quant.Int4Linear(got, None, torch.bfloat16)
    held = quant.codes_from_lanes(layer.codes) if layer.lanes else layer.codes
    assert torch.equal(held, stored)


def test_q4_k_nibble_pairs_hold_each_sub_block_of_32() -> None:
    """Q4_K packs 64 elements per 32 bytes (the first 32 low, the next 32 high): its pairs are
    made per sub-block of 32, and unpacked they are the codes the gguf library decodes."""
    raw = np.random.default_rng(5).integers(0, 256, (16 * 2, 144), dtype=np.uint8)
    got = decode_blocks(raw, "Q4_K", 16, 512)
    assert got.pairs.shape == (16, 16, 16)
    chunks = torch.from_numpy(raw.reshape(-1, 144)[:, 16:].copy()).view(-1, 4, 32)
    codes = torch.stack([chunks & 15, chunks >> 4], dim=2).reshape(16, 512)
    assert torch.equal(got.q, codes)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_nibble_pairs_pack_and_unpack_any_group(group: int) -> None:
    codes = torch.randint(0, 16, (8, 256), dtype=torch.uint8)
    pairs = quant.pack_pairs(codes, group)
    assert pairs.shape == (8, 256 // group, group // 2)
    assert torch.equal(pairs[:, 0, 0], codes[:, 0] | (codes[:, group // 2] << 4))
    assert torch.equal(quant.unpack_pairs(pairs).reshape(8, 256), codes)


def _k_blocks(kind: str, rows: int, cols: int) -> np.ndarray:
    """Random super-blocks of a K type the gguf library cannot quantize (Q5_K, Q6_K), with
    sane float16 scales: any bytes are a valid block."""
    size = {"Q5_K": 176, "Q6_K": 210}[kind]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    if kind == "Q5_K":
        blocks[:, 0:2] = np.float16(0.011).reshape(1, 1).view(np.uint8)  # d
        blocks[:, 2:4] = np.float16(0.017).reshape(1, 1).view(np.uint8)  # dmin
    else:
        blocks[:, -2:] = np.float16(0.0023).reshape(1, 1).view(np.uint8)  # d, last
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_five_and_six_bit_blocks_are_eight_bit_blocks_on_the_native_kernels(kind: str) -> None:
    """Where the native kernels run, 5- and 6-bit weights become int8 codes with a float16
    scale per block of 32 (not dense): each value within half an 8-bit step of its block (and
    the scale's float16 rounding); elsewhere they stay dense as before."""
    from types import SimpleNamespace

    from stallfree.runtime.model import cpu_kernels
    from stallfree.runtime.model.gguf_blocks import packed_weight

    qtype = gguf.GGMLQuantizationType[kind]
    rows, cols = 24, 512
    if kind in ("Q5_K", "Q6_K"):
        raw = _k_blocks(kind, rows, cols)
    else:
        raw = gguf.quants.quantize(_random_weight(rows, cols, seed=3), qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    tensor = SimpleNamespace(tensor_type=qtype, shape=(cols, rows), data=raw)
    got = packed_weight(tensor)
    if not cpu_kernels.available():
        assert got is None
        return
    assert isinstance(got, quant.BlockQuant8) and got.scale.dtype == torch.float16
    step = np.abs(expected).reshape(rows, cols // 32, 32).max(-1, keepdims=True) / 127
    err = np.abs(
        got.dequantize().numpy().reshape(rows, cols // 32, 32)
        - expected.reshape(rows, cols // 32, 32)
    )
    assert np.all(err <= step * (0.5 + 2e-3) + 1e-7)


def test_q4_k_super_blocks_decode_exactly() -> None:
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (32, 144), dtype=np.uint8)  # 16 rows x 512 columns
    blocks[:, 0:2] = np.float16(0.013).reshape(1, 1).view(np.uint8)
    blocks[:, 2:4] = np.float16(0.021).reshape(1, 1).view(np.uint8)
    raw = blocks.reshape(16, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(16, 512)
    got = decode_blocks(raw, "Q4_K", 16, 512).dequantize().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def _reference(x: torch.Tensor, weight: quant.QuantizedWeight) -> torch.Tensor:
    return x.float() @ weight.dequantize().t()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 24, 31, 64, 71])
def test_quantized_linear_matches_its_dequantised_weight(
    bits: int, dtype: torch.dtype, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 128, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen)
    weight = quant.quantize_int8(w) if bits == 8 else quant.quantize_int4(w)
    layer = (quant.Int8Linear if bits == 8 else quant.Int4Linear)(weight, bias, dtype)
    x = torch.randn(rows, 128, generator=gen)
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, 96)
    expected = _reference(x, weight) + bias
    # bfloat16 activations (on the kernel, and in a bfloat16 model) round at 2^-8
    tol = 0.02 * expected.abs().max().item()
    assert (out.float() - expected).abs().max().item() <= tol
    # 3-D activations keep their leading shape
    assert layer(x.to(dtype).view(1, rows, 128)).shape == (1, rows, 96)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_error_is_bounded_by_its_step(bits: int) -> None:
    w = torch.randn(64, 256) * 0.1
    weight = quant.quantize_int8(w) if bits == 8 else quant.quantize_int4(w)
    err = (weight.dequantize() - w).abs()
    if bits == 8:
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        groups = w.view(64, 8, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    assert torch.all(err <= step / 2 + 1e-6)


@pytest.mark.parametrize("cols", [65, 40, 100])
def test_int8_widths_the_kernel_mishandles_take_the_dense_path(cols: int) -> None:
    """torch's bfloat16 int8 kernel crashed (65 inputs: SIGSEGV) or summed wrong (40) on
    widths off a multiple of 32: such layers always dequantise."""
    w = torch.randn(64, cols) * 0.05
    weight = quant.quantize_int8(w)
    layer = quant.Int8Linear(weight, None, torch.bfloat16)
    assert layer.kernel_max_rows == 0
    x = torch.randn(3, cols)
    out = layer(x.to(torch.bfloat16)).float()
    expected = _reference(x, weight)
    assert (out - expected).abs().max().item() <= 0.02 * expected.abs().max().item()
    assert (
        quant.Int8Linear(
            quant.quantize_int8(torch.randn(64, 96)), None, torch.bfloat16
        ).kernel_max_rows
        > 0
    )


def test_int4_falls_back_to_int8_where_the_kernel_cannot_take_the_shape() -> None:
    w = torch.randn(40, 64)  # 40 output rows: not a multiple of 16
    assert isinstance(quant.make_linear(w, None, "int4", torch.float32), quant.Int8Linear)
    assert isinstance(quant.make_linear(w[:32], None, "int4", torch.float32), quant.Int4Linear)
    assert quant.make_linear(w, None, "none", torch.float32) is None


def test_int4_dense_path_shares_one_workspace_per_shape() -> None:
    b_weight = torch.randn(32, 64)
    a = quant.Int4Linear(quant.quantize_int4(torch.randn(32, 64)), None, torch.float32)
    b = quant.Int4Linear(quant.quantize_int4(b_weight), None, torch.float32)
    assert a.dequantize().data_ptr() == b.dequantize().data_ptr()
    # and each call expands its own weight into it
    w = quant.quantize_int4(b_weight)
    expected = w.dequantize()
    if b.native:  # the native kernels hold the group scales and offsets in float16
        g = w.group_size
        offset = (w.zero - 8 * w.scale).half().float().repeat_interleave(g, 1)
        expected = w.q.float() * w.scale.half().float().repeat_interleave(g, 1) + offset
    torch.testing.assert_close(b.dequantize(), expected)


# ---------------------------------------------------------------------------- models


def _logits(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    harness = Harness(model)
    harness.kv = type(harness.kv)(harness.kv.shape, harness.kv.num_slots, dtype, CPU)
    prefill = harness.run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)])
    decode = harness.run(ForwardMode.DECODE, [(0, [65]), (1, [66])])
    return torch.cat([prefill, decode])


def _assert_close_logits(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    spread = want.std().item()
    print(f"max |logit diff| {(got - want).abs().max().item():.4f}, logit std {spread:.4f}")
    assert (got - want).abs().max().item() <= rel * spread, (got - want).abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("quant"), tie_word_embeddings=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_projections_take_no_random_init(
    llama: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stacked q/k/v and gate/up linears are made without nn.Linear's random init, which
    filled each one before its stacked rows overwrote it (on the 1B Llama, 2.9 s of a 3.6 s
    load); their weights are the checkpoint's rows, stacked."""
    from safetensors.torch import load_file

    inits: list[tuple[int, ...]] = []
    real = torch.nn.init.kaiming_uniform_

    def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if not tensor.is_meta:  # the model is built on the meta device, its init skipped
            inits.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", counted)
    loaded = load_model(str(llama), dtype, CPU, 0, quantization="none")
    assert inits == []
    ckpt = load_file(str(llama / "model.safetensors"))
    fused = 0
    for i, layer in enumerate(loaded.model.model.layers):
        for module, parts in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                              (layer.mlp, ("gate_proj", "up_proj"))):  # fmt: skip
            name = "qkv_proj" if module is layer.self_attn else "gate_up_proj"
            joint = getattr(module, name)
            if joint is None:
                continue
            kind = "self_attn" if module is layer.self_attn else "mlp"
            rows = [ckpt[f"model.layers.{i}.{kind}.{p}.weight"] for p in parts]
            assert torch.equal(joint.weight, torch.cat(rows).to(joint.weight.dtype))
            fused += 1
    stacked = dtype == "bfloat16" or native_layers.stacks_float32(CPU)
    assert fused == (2 * len(loaded.model.model.layers) if stacked else 0)


def test_fusing_a_fused_model_again_changes_nothing(llama: Path) -> None:
    """`fuse_projections` on a model already stacked (every bfloat16 one; a float32 one off
    Intel) leaves each stacked layer as it is, where it used to look for the parts it had
    removed."""
    loaded = load_model(str(llama), "bfloat16", CPU, 0, quantization="none")
    layers = loaded.model.model.layers
    before = [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in layers]
    assert all(qkv is not None and gate_up is not None for qkv, gate_up in before)
    assert loaded.model.fuse_projections() == 0
    assert [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in layers] == before


def _dequantised_copy(packed: torch.nn.Module, dense: torch.nn.Module) -> torch.nn.Module:
    """`dense` with every weight that `packed` quantized replaced by its dequantised values."""
    with torch.no_grad():
        for name, module in packed.named_modules():
            if isinstance(module, quant.Int8Linear | quant.Int4Linear):
                # a tied output matrix is listed once, under the embedding it also serves
                target = name.removesuffix(".head")
                dense.get_submodule(target).weight.copy_(module.dequantize())
    return dense


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_computes_what_its_dequantised_weights_do(llama: Path, method: str) -> None:
    dense = load_model(str(llama), "float32", CPU, 0)
    packed = load_model(str(llama), "float32", CPU, 0, quantization=method)
    assert packed.quantization == method
    layer = packed.model.model.layers[0]
    kind = quant.Int8Linear if method == "int8" else quant.Int4Linear
    # q/k/v and gate/up fused into one layer each, then quantized
    assert isinstance(layer.self_attn.qkv_proj, kind) and isinstance(layer.mlp.gate_up_proj, kind)
    assert isinstance(layer.mlp.down_proj, kind) and not hasattr(layer.self_attn, "q_proj")
    # the tied output matrix is int8 and also serves the embedding lookup
    assert isinstance(packed.model.tied_head, quant.Int8Linear)
    assert isinstance(packed.model.model.embed_tokens, quant.Int8Embedding)
    assert quant.weight_bytes(packed.model) < quant.weight_bytes(dense.model) * 0.7
    dense.model.fuse_projections()  # as the quantized model's layers are
    reference = _dequantised_copy(packed.model, dense.model)
    # what remains is the activations' rounding to bfloat16 on the kernel (where the CPU has it)
    _assert_close_logits(
        _logits(packed.model, torch.float32), _logits(reference, torch.float32), 0.15
    )


@pytest.mark.parametrize(
    ("layer_type", "layer_kind"),
    [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8"), ("Q5_0", "int8"), ("Q5_1", "int8")],
)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_blocks_stay_packed_and_compute_what_the_dequantised_file_does(
    tmp_path: Path, layer_type: str, layer_kind: str, tied: bool
) -> None:
    model_dir = make_llama(tmp_path, tie_word_embeddings=tied)
    path = write_gguf(model_dir, tmp_path / "q.gguf", layer_type=layer_type, embed_type="Q8_0")
    dense = load_model(str(path), "float32", CPU, 0, quantization="none")
    packed = load_model(str(path), "float32", CPU, 0, quantization="auto")  # gguf on a CPU
    assert packed.quantization == "gguf"
    kind: type[torch.nn.Module] = quant.Int4Linear if layer_kind == "int4" else quant.Int8Linear
    if layer_type.startswith("Q5") and not cpu_kernels.available():
        kind = torch.nn.Linear  # 5-bit types stay dense without the native kernels
    for layer in packed.model.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert isinstance(proj, kind)
    head = packed.model.tied_head if tied else packed.model.lm_head
    assert isinstance(head, quant.Int8Linear)
    # Q4 and Q8_0 blocks hold the dequantised values exactly: only the activations' rounding
    # on the kernel (bfloat16 or int8 blocks) remains; Q5 types add their re-quantization to
    # 8-bit blocks (half a step of each block at most)
    tolerance = 0.15 if layer_type.startswith("Q5") else 0.1
    _assert_close_logits(
        _logits(packed.model, torch.float32), _logits(dense.model, torch.float32), tolerance
    )


def test_quantization_setting_resolves_and_refuses_clearly(tmp_path: Path) -> None:
    assert resolve_quantization("auto", "tiny", CPU) == "none"
    assert resolve_quantization("auto", str(tmp_path / "m.gguf"), CPU) == "gguf"
    assert resolve_quantization("auto", str(tmp_path / "m.gguf"), torch.device("cuda")) == "none"
    assert resolve_quantization("int4", "tiny", CPU) == "int4"
    with pytest.raises(ModelLoadError, match="GGUF file's blocks"):
        resolve_quantization("gguf", "tiny", CPU)
    with pytest.raises(ModelLoadError, match="CPU integer kernels"):
        resolve_quantization("int8", "tiny", torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="unsupported quantization"):
        resolve_quantization("awq", "tiny", CPU)


def test_quantization_flag_sets_the_config() -> None:
    from stallfree.entrypoints.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "tiny", "--quantization", "int4"])
    assert config_from_args(args).model.quantization == "int4"
    args = build_parser().parse_args(["serve", "tiny", "-q", "int8"])
    assert config_from_args(args).model.quantization == "int8"


@pytest.mark.parametrize("worker", ["inprocess", "process"])
async def test_quantized_engine_serves_and_frees_everything(worker: str) -> None:
    """The engine on a quantized model, in process and in a worker process (which loads its
    own copy from the setting): the same greedy tokens, every pool back to full."""
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    runtime = {"worker": worker}
    cfg = engine_config("tiny", model={"quantization": "int4"}, runtime=runtime)
    async with Engine(cfg) as engine:
        got = [(await engine.complete(p, params)).token_ids for p in prompts]
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    ref_cfg = engine_config("tiny", model={"quantization": "int4"})
    async with Engine(ref_cfg) as engine:
        want = [(await engine.complete(p, params)).token_ids for p in prompts]
    assert got == want
    assert all(len(t) == 8 for t in got)


def test_quantize_takes_each_packed_weight_out_as_its_layer_is_built(llama: Path) -> None:
    """A GGUF file's packed weights leave `packed` as their layers are built (the tied output
    matrix too), so a layer that re-lays its codes out (quant.rows_in_lanes) frees the file's
    order as it goes instead of holding every weight twice until the load ends."""
    loaded = load_model(str(llama), "bfloat16", CPU, 0)
    model = loaded.model
    down = model.model.layers[0].mlp.down_proj
    embed = model.model.embed_tokens.weight.detach()
    packed: dict[str, quant.QuantizedWeight] = {
        "model.layers.0.mlp.down_proj.weight": quant.quantize_int8_blocks(down.weight.detach()),
        "model.embed_tokens.weight": quant.quantize_int8_blocks(embed),
    }
    swapped = model.quantize("gguf", torch.bfloat16, packed)
    assert packed == {}
    assert isinstance(swapped["model.layers.0.mlp.down_proj"], quant.Int8Linear)
    assert isinstance(model.tied_head, quant.Int8Linear)
