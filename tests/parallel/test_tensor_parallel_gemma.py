"""Tensor-parallel Gemma 2 and Gemma 3 over gloo: two spawned ranks against tp_size=1 and
transformers; heads and MLP split as Llama's, every norm (q/k ones included) replicated."""

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
from tests.hf_models import hf_logits, make_gemma2, make_gemma3
from tests.model_harness import CPU, PROMPT_A, PROMPT_B
from tests.parallel.test_tensor_parallel_model import _free_port, run_greedy
from tests.process_util import leave_group

TP = 2
ATOL = 1e-4
SPAWN_TIMEOUT_S = 120.0
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "gemma2": (make_gemma2, {}),
    # one KV head, replicated on both ranks
    "gemma3_kv1": (make_gemma3, {"num_key_value_heads": 1}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_gemma")
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
    out = tmp_path_factory.mktemp("tp_gemma_out")
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
        assert run["tokens"] == single["tokens"]
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
    shapes = tp_runs[1]["gemma3_kv1"]["shapes"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # the one KV head
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)  # replicated
    assert shapes["model.layers.0.pre_feedforward_layernorm.weight"] == (64,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert shapes["model.embed_tokens.weight"] == (130, 64)  # vocab-parallel, tied
