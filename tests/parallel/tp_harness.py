"""Tensor parallelism over gloo for the model tests: two spawned ranks run one module-level
`work(tp, dirs)` each (spawning costs seconds, so one spawn serves every case of a module) and
save its results to a file that the test process compares against tp_size=1 and transformers."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from stallfree.runtime.model import LoadedModel, load_model, native_layers
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.parallel import TPGroup
from tests.hf_models import hf_logits
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness
from tests.process_util import leave_group

TP = 2
ATOL = 1e-4
DECODE_STEPS = 3
LOGIT_POSITIONS = [2, 15]  # extra prompt rows (prompt logprobs): A[2] and B[3]
SPAWN_TIMEOUT_S = 120.0

Work = Callable[[TPGroup, dict[str, str]], dict[str, Any]]


def model_dirs(cases: dict[str, tuple[Any, dict[str, Any]]], root: Path) -> dict[str, Path]:
    """Each case's tiny checkpoint: `builder(root / name, **overrides)`."""
    return {name: make(root / name, **dict(kw)) for name, (make, kw) in cases.items()}


def run_greedy(loaded: LoadedModel) -> dict[str, Any]:
    """A batched prefill of A and B (with extra prompt rows), then greedy decode steps."""
    h = Harness(loaded.model, num_slots=256, max_context=128, kv_shape=loaded.kv_cache_shape())
    steps = [h.run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)], LOGIT_POSITIONS)]
    tokens: list[list[int]] = [[], []]
    for _ in range(DECODE_STEPS):
        nxt = steps[-1][:2].argmax(-1).tolist()
        for row, t in enumerate(nxt):
            tokens[row].append(t)
        steps.append(h.run(ForwardMode.DECODE, [(0, [nxt[0]]), (1, [nxt[1]])]))
    for row, t in enumerate(steps[-1].argmax(-1).tolist()):
        tokens[row].append(t)
    return {"logits": steps, "tokens": tokens}


def param_shapes(path: str, tp: TPGroup) -> dict[str, tuple[int, ...]]:
    """This rank's shard shapes under the checkpoint's names: the model loaded again with q/k/v
    and gate/up apart (a float32 model stacks them on a CPU not Intel's where the kernels are
    built, `native_layers.stacks_float32`, as the greedy run's model does there)."""
    with mock.patch.object(native_layers, "stacks_float32", lambda device: False):
        loaded = load_model(path, "float32", CPU, 0, tp=tp)
    return {name: tuple(p.shape) for name, p in loaded.model.named_parameters()}


def greedy_and_shapes(tp: TPGroup, dirs: dict[str, str]) -> dict[str, Any]:
    """A `Work`: each checkpoint's greedy run on this rank's shards, with the shard shapes."""
    results: dict[str, Any] = {}
    for name, path in dirs.items():
        loaded = load_model(path, "float32", CPU, 0, tp=tp)
        results[name] = run_greedy(loaded) | {"shapes": param_shapes(path, tp)}
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, work: Work, dirs: dict[str, str], out: str) -> None:
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
        torch.save(work(TPGroup.from_distributed(), dirs), Path(out) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()  # saved: exit 0 without a teardown that can abort


def spawn_ranks(work: Work, dirs: dict[str, str], out: Path) -> list[Any]:
    """Each rank's `work(tp, dirs)` results, from one spawn of `TP` ranks."""
    ctx = mp.spawn(_rank_main, args=(free_port(), work, dirs, str(out)), nprocs=TP, join=False)
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


def assert_matches_tp1(tp_runs: list[Any], name: str, model_dir: Path, hf: bool = True) -> None:
    """Every rank's greedy tokens and logits equal tp_size=1's; with `hf`, the prefill's last
    rows equal transformers' too."""
    single = run_greedy(load_model(str(model_dir), "float32", CPU, 0))
    for rank in range(TP):
        run = tp_runs[rank][name]
        assert run["tokens"] == single["tokens"], f"rank {rank}"
        for got, want in zip(run["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if not hf:
        return
    prefill = tp_runs[0][name]["logits"][0]
    torch.testing.assert_close(prefill[0], hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(prefill[1], hf_logits(model_dir, PROMPT_B)[-1], atol=ATOL, rtol=0)
