"""Tensor-parallel Gemma 2 and Gemma 3 over gloo: two spawned ranks against tp_size=1 and
transformers; heads and MLP split as Llama's, every norm (q/k ones included) replicated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.hf_models import make_gemma2, make_gemma3
from tests.parallel.tp_harness import (
    assert_matches_tp1,
    greedy_and_shapes,
    model_dirs,
    spawn_ranks,
)

CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "gemma2": (make_gemma2, {}),
    # one KV head, replicated on both ranks
    "gemma3_kv1": (make_gemma3, {"num_key_value_heads": 1}),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return model_dirs(CASES, tmp_path_factory.mktemp("tp_gemma"))


@pytest.fixture(scope="module")
def tp_runs(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    paths = {name: str(path) for name, path in dirs.items()}
    return spawn_ranks(greedy_and_shapes, paths, tmp_path_factory.mktemp("tp_gemma_out"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1_and_transformers(
    name: str, tp_runs: list[Any], dirs: dict[str, Path]
) -> None:
    assert_matches_tp1(tp_runs, name, dirs[name])


@pytest.mark.slow
def test_rank_shards(tp_runs: list[Any]) -> None:
    shapes = tp_runs[1]["gemma3_kv1"]["shapes"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # the one KV head
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)  # replicated
    assert shapes["model.layers.0.pre_feedforward_layernorm.weight"] == (64,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert shapes["model.embed_tokens.weight"] == (130, 64)  # vocab-parallel, tied
