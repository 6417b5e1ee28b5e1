"""Tensor-parallel Qwen3 and Phi-3 over gloo: two spawned ranks against tp_size=1 and
transformers. Qwen3's per-head q/k norms are replicated; Phi-3's fused checkpoint tensors are
split into q/k/v and gate/up at load, then sharded like Llama's."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from stallfree.runtime.model import load_model
from stallfree.runtime.model.parallel import TPGroup
from tests.hf_models import hf_logits, make_phi3, make_qwen3
from tests.model.test_families_dense import LONGROPE, YARN
from tests.model_harness import CPU, PROMPT_A, PROMPT_B
from tests.parallel.test_tensor_parallel_model import _free_port, run_greedy
from tests.process_util import leave_group

TP = 2
ATOL = 1e-4
SPAWN_TIMEOUT_S = 120.0
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
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_dense")
    return {name: make(root / name, **dict(kw)) for name, (make, kw) in CASES.items()}


def _rank_main(rank: int, port: int, dirs: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=TP,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        tp = TPGroup.from_distributed()
        results: dict[str, Any] = {}
        for name, path in dirs.items():
            loaded = load_model(path, "float32", CPU, 0, tp=tp)
            results[name] = run_greedy(loaded)
            results[name]["shapes"] = {
                n: tuple(p.shape) for n, p in loaded.model.named_parameters()
            }
        torch.save(results, Path(out) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()  # saved: exit 0 without a teardown that can abort


@pytest.fixture(scope="module")
def tp_runs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    out = tmp_path_factory.mktemp("tp_dense_out")
    dirs = {name: str(path) for name, path in model_dirs.items()}
    ctx = mp.spawn(_rank_main, args=(_free_port(), dirs, str(out)), nprocs=TP, join=False)
    try:
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"tensor-parallel ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [torch.load(out / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1_and_transformers(
    name: str, tp_runs: list[Any], model_dirs: dict[str, Path]
) -> None:
    single = run_greedy(load_model(str(model_dirs[name]), "float32", CPU, 0))
    for rank in range(TP):
        run = tp_runs[rank][name]
        assert run["tokens"] == single["tokens"], f"rank {rank}"
        for got, want in zip(run["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    prefill = tp_runs[0][name]["logits"][0]
    torch.testing.assert_close(
        prefill[0], hf_logits(model_dirs[name], PROMPT_A)[-1], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        prefill[1], hf_logits(model_dirs[name], PROMPT_B)[-1], atol=ATOL, rtol=0
    )


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
