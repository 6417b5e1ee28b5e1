"""GGUF files of mixture-of-experts models, written as llama.cpp's converter does (experts
stacked per projection, `llama` for Mixtral, `qwen2moe`, `qwen3moe`), against transformers on the
models they were written from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from stallfree import Engine
from stallfree.runtime.model import load_model
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.gguf_moe import EXPERT_TENSORS, ROUTER, SHARED_TENSORS
from stallfree.runtime.model.moe import SparseMoeBlock
from tests.engine_util import engine_config, run_greedy
from tests.hf_models import hf_greedy, hf_logits, make_mixtral, make_qwen2_moe, make_qwen3_moe
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness

gguf = pytest.importorskip("gguf", reason="pip install 'stallfree[gguf]'")

from tests.model.test_gguf import add_byte_level_tokenizer, llama_cpp_permute  # noqa: E402

# HF expert projection -> the gguf package's stacked-expert tensor
_STACKED = {
    "w1": "FFN_GATE_EXP",
    "gate_proj": "FFN_GATE_EXP",
    "w3": "FFN_UP_EXP",
    "up_proj": "FFN_UP_EXP",
    "w2": "FFN_DOWN_EXP",
    "down_proj": "FFN_DOWN_EXP",
}


def write_moe_gguf(model_dir: Path, out: Path, arch: str, layer_type: str = "F32") -> Path:
    """A GGUF of the HF MoE model in `model_dir`; `layer_type` for the attention projections."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads, layers = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["num_hidden_layers"],
    )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    model_arch = gguf.MODEL_ARCH[arch.upper()]
    names = gguf.get_tensor_name_map(model_arch, layers)

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta") or cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    vocab = add_byte_level_tokenizer(writer, tok, cfg["vocab_size"])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(False)
    stacked: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        w = tensor.float().numpy()
        if ".experts." in name:  # model.layers.L.<block>.experts.E.<proj>.weight
            parts = name.split(".")
            stacked.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, kv_heads)
        gguf_name = names.get_name(name, (".weight", ".bias"))
        assert gguf_name is not None, name
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp's [n_embd] vector
        if layer_type != "F32" and name.endswith(("q_proj.weight", "o_proj.weight")):
            qtype = gguf.GGMLQuantizationType[layer_type]
            raw = gguf.quants.quantize(np.ascontiguousarray(w), qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for (layer, proj), experts in sorted(stacked.items()):
        kind = gguf.MODEL_TENSOR[_STACKED[proj]]
        assert kind in gguf.MODEL_TENSORS[model_arch]
        stack = np.stack([experts[e] for e in sorted(experts)])  # [E, out, in]
        writer.add_tensor(f"{gguf.TENSOR_NAMES[kind].format(bid=layer)}.weight", stack)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


CASES: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "mixtral": (make_mixtral, "llama", {}),
    # llama.cpp's qwen2moe routes every layer (it has no dense-layer tensors)
    "qwen2_moe": (make_qwen2_moe, "qwen2moe", {"mlp_only_layers": []}),
    "qwen3_moe": (make_qwen3_moe, "qwen3moe", {}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("moe_gguf")
    out = {}
    for name, (make, arch, kw) in CASES.items():
        model_dir = make(root / name, **kw)
        out[name] = (model_dir, write_moe_gguf(model_dir, root / f"{name}.gguf", arch))
    return out


def test_runtime_names_are_the_gguf_packages() -> None:
    for arch in ("LLAMA", "QWEN2MOE", "QWEN3MOE"):
        known = {
            gguf.TENSOR_NAMES[t].format(bid=0) + ".weight"
            for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch]]
        }
        assert {f"blk.0.{n}" for n in (ROUTER, *EXPERT_TENSORS)} <= known
    qwen2moe = {
        gguf.TENSOR_NAMES[t].format(bid=0) + ".weight"
        for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN2MOE]
    }
    assert {f"blk.0.{n}" for n in SHARED_TENSORS} <= qwen2moe


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_weights_and_logits_equal_the_checkpoints(
    files: dict[str, tuple[Path, Path]], name: str
) -> None:
    model_dir, path = files[name]
    loaded = load_model(str(path), "float32", CPU, 0, quantization="none")
    expected_arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    assert loaded.arch.architecture == expected_arch and loaded.arch.moe is not None
    from_dir = load_model(str(model_dir), "float32", CPU, 0).model.state_dict()
    for key, param in loaded.model.state_dict().items():
        assert torch.equal(param, from_dir[key]), key  # Q/K rows back in HF order, experts split
    assert set(loaded.model.state_dict()) == set(from_dir)
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.model.layers)
    logits = Harness(loaded.model).run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)])
    torch.testing.assert_close(logits[0], hf_logits(model_dir, PROMPT_A)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(model_dir, PROMPT_B)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
async def test_gguf_engine_greedy_equals_transformers(
    files: dict[str, tuple[Path, Path]], name: str
) -> None:
    model_dir, path = files[name]
    cfg = engine_config(str(path), scheduler={"chunked_prefill_size": 7})
    async with Engine(cfg) as engine:
        got = await run_greedy(engine, [PROMPT_A, PROMPT_B], 8)
    assert got == [hf_greedy(model_dir, PROMPT_A, 8), hf_greedy(model_dir, PROMPT_B, 8)]


def test_gguf_quantization_keeps_attention_packed_and_experts_dense(
    tmp_path: Path, files: dict[str, tuple[Path, Path]]
) -> None:
    from stallfree.runtime.model import quant

    model_dir, _ = files["mixtral"]
    path = write_moe_gguf(model_dir, tmp_path / "q8.gguf", "llama", layer_type="Q8_0")
    loaded = load_model(str(path), "float32", CPU, 0, quantization="gguf")
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, quant.Int8Linear)
    expert = layer.block_sparse_moe.experts[0]
    assert isinstance(expert.w1, torch.nn.Linear) and expert.w1.weight.dtype == torch.float32
    dense = load_model(str(path), "float32", CPU, 0, quantization="none")
    got = Harness(loaded.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    want = Harness(dense.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    assert (got - want).abs().mean() <= 0.05 * want.std()
