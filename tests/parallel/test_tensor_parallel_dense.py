"""Tensor-parallel Qwen3 and Phi-3 over gloo: two spawned ranks against tp_size=1 and
transformers. Qwen3's per-head q/k norms are replicated; Phi-3's fused checkpoint tensors are
split into q/k/v and gate/up at load, then sharded like Llama's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.hf_models import make_phi3, make_qwen3
from tests.model.test_families_dense import LONGROPE, YARN
from tests.parallel.tp_harness import (
    assert_matches_tp1,
    greedy_and_shapes,
    model_dirs,
    spawn_ranks,
)

CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    # 2 KV heads split 1 + 1, yarn
    "qwen3_kv2_yarn": (make_qwen3, YARN),
    # 1 KV head replicated on both ranks, q/k/v and o biases, tied embeddings
    "qwen3_kv1_bias_tied": (
        make_qwen3,
        {"num_key_value_heads": 1, "attention_bias": True, "tie_word_embeddings": True},
    ),
    # fused qkv_proj / gate_up_proj split then sharded; longrope; odd intermediate size
    "phi3_longrope_odd": (make_phi3, {**LONGROPE, "intermediate_size": 129}),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return model_dirs(CASES, tmp_path_factory.mktemp("tp_dense"))


@pytest.fixture(scope="module")
def tp_runs(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    paths = {name: str(path) for name, path in dirs.items()}
    return spawn_ranks(greedy_and_shapes, paths, tmp_path_factory.mktemp("tp_dense_out"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1_and_transformers(
    name: str, tp_runs: list[Any], dirs: dict[str, Path]
) -> None:
    assert_matches_tp1(tp_runs, name, dirs[name])


@pytest.mark.slow
def test_rank_shards(tp_runs: list[Any]) -> None:
    for runs in tp_runs:
        qwen3 = runs["qwen3_kv1_bias_tied"]["shapes"]
        attn = "model.layers.0.self_attn"
        assert qwen3[f"{attn}.q_proj.weight"] == (2 * 32, 64)  # 2 of 4 heads of 32
        assert qwen3[f"{attn}.k_proj.weight"] == (32, 64)  # the one KV head
        assert qwen3[f"{attn}.q_norm.weight"] == qwen3[f"{attn}.k_norm.weight"] == (32,)
        assert qwen3[f"{attn}.o_proj.bias"] == (64,)  # replicated, added once
        phi3 = runs["phi3_longrope_odd"]["shapes"]
        assert phi3[f"{attn}.q_proj.weight"] == (32, 64)
        assert phi3[f"{attn}.v_proj.weight"] == (16, 64)
        assert phi3["model.layers.0.mlp.up_proj.weight"] == (65, 64)  # ceil(129 / 2), padded
        assert not any("qkv_proj" in n or "gate_up_proj" in n for n in phi3)
