"""LoRA under tensor parallelism, at the model: A and B cut as their base layers are (a
column-parallel target's B by rows, a row-parallel target's A by columns, padded alike), and
two gloo ranks running three adapters and the base model in one batch, fused and unfused, in
both delta paths, against transformers + peft merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stallfree.config import load_config
from stallfree.runtime.lora.checkpoint import read_adapter
from stallfree.runtime.lora.workers import WorkerSlots
from stallfree.runtime.model import load_model
from stallfree.runtime.model import lora as model_lora
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.forward_batch import ForwardMode, LoraBatch
from stallfree.runtime.model.loader import read_arch
from stallfree.runtime.model.parallel import TPGroup
from tests.hf_models import make_llama
from tests.lora_models import ADAPTERS, make_adapter
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness
from tests.parallel.tp_harness import TP, spawn_ranks

# an intermediate size that two ranks split unevenly (the last shard zero-padded), one KV
# head, which both ranks hold, and biases (o_proj's added once, after the all-reduce)
ODD = {"intermediate_size": 99, "num_key_value_heads": 1, "attention_bias": True}
PROMPTS = [PROMPT_A, PROMPT_B, PROMPT_A[:7], PROMPT_B[2:]]
SLOTS = [0, 1, 2, -1]  # row i under ADAPTERS' i-th adapter; the last row the base model
ATOL = 1e-4


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory) -> tuple[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("odd")
    path = make_llama(root, **ODD)
    adapters = {
        name: str(make_adapter(path, root / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    return str(path), adapters


def _whole(arch: ModelArchConfig, adapter: str) -> model_lora.Weights:
    shapes = WorkerSlots.for_arch(arch, []).shapes
    return read_adapter("x", adapter, shapes, 16, torch.float32).weights


def test_each_rank_holds_its_base_layers_shards(odd_model):
    """Column targets: B's rows side by side over the ranks are the whole B (the padding
    zero), A whole on each. Row targets: A's columns side by side, B whole; each rank's
    partial delta sums to the whole delta."""
    path, adapters = odd_model
    arch = read_arch(path)
    whole = _whole(arch, adapters["mlp-r16-rs"]) | _whole(arch, adapters["attn-r4"])
    cuts = [model_lora.cut_for_rank(whole, arch, TPGroup(r, TP)) for r in range(TP)]
    for key, (a, b, _) in whole.items():
        parts = [cut[key] for cut in cuts]
        target = key[1]
        if target in ("o_proj", "down_proj"):
            assert all(torch.equal(p[1], b) for p in parts)
            cols = torch.cat([p[0] for p in parts], dim=1)
            assert torch.equal(cols[:, : a.shape[1]], a) and not cols[:, a.shape[1] :].any()
            x = torch.randn(3, cols.shape[1])
            x[:, a.shape[1] :] = 0  # the padded activations are zero too
            xs = x.split(parts[0][0].shape[1], dim=1)
            delta = sum((xs[r] @ p[0].T) @ b.T for r, p in enumerate(parts))
            torch.testing.assert_close(delta, (x[:, : a.shape[1]] @ a.T) @ b.T)
        elif target in ("k_proj", "v_proj"):  # one KV head: both ranks hold all of it
            assert all(torch.equal(p[1], b) and torch.equal(p[0], a) for p in parts)
        else:
            assert all(torch.equal(p[0], a) for p in parts)
            rows = torch.cat([p[1] for p in parts], dim=0)
            assert torch.equal(rows[: b.shape[0]], b) and not rows[b.shape[0] :].any()
    down = cuts[1][(0, "down_proj")][0]
    assert down.shape[1] == 50 and not down[:, -1].any()  # 99 = 50 + 49, padded to 50


def test_tensor_parallelism_and_worker_processes_take_lora():
    """Refused once ("do not compose with worker processes"); the other refusals stand."""
    lora = {"enable_lora": True}
    cfg = load_config(model={"path": "tiny"}, lora=lora, parallel={"tp_size": 2})
    assert cfg.uses_worker_processes and cfg.lora.enable_lora
    with pytest.raises(ValueError, match=r"do not compose with runtime\.torch_compile"):
        load_config(model={"path": "tiny"}, lora=lora, runtime={"torch_compile": True})


# ---------------------------------------------------------------------------- two ranks


def _forward(tp: TPGroup, path: str, adapters: dict[str, str], fused: bool) -> torch.Tensor:
    loaded = load_model(path, "float32", CPU, 0, tp=tp)
    model = loaded.model
    if fused:
        model.fuse_projections()
    table = model_lora.install(model, 4, 16, torch.float32)
    for slot, adapter in enumerate(adapters.values()):
        table.write(slot, _whole(loaded.arch, adapter))
    h = Harness(model, num_slots=256, max_context=128, kv_shape=loaded.kv_cache_shape())
    fb = h.batch(ForwardMode.EXTEND, list(enumerate(PROMPTS)))
    fb.lora = LoraBatch.build(SLOTS, fb.extend_lens_cpu, lambda t: t)
    with torch.inference_mode():
        return model(fb)


def _work(tp: TPGroup, dirs: dict[str, str]) -> dict[str, Any]:
    """On each rank: the batch's logits, unfused and fused, in the one-pass and the
    by-adapter path."""
    path = dirs.pop("model")
    out: dict[str, Any] = {}
    for fused in (False, True):
        for share, way in ((0, "one-pass"), (10**9, "by-adapter")):
            model_lora.DENSE_MAX_SHARE = share
            out[f"fused={fused} {way}"] = _forward(tp, path, dirs, fused)
    return out


def _merged_logits(base: str, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from tests.lora_models import _merged

    if adapter is None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    else:
        model = _merged(base, adapter)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


@pytest.mark.slow
def test_two_ranks_equal_merged_peft(odd_model, tmp_path: Path):
    path, adapters = odd_model
    runs = spawn_ranks(_work, {"model": path, **adapters}, tmp_path)
    names: list[str | None] = [*adapters.values(), None]
    want = torch.stack([_merged_logits(path, names[i], p) for i, p in enumerate(PROMPTS)])
    base = _merged_logits(path, None, PROMPTS[0])
    assert (want[0] - base).abs().max() > 0.1  # the adapter matters at this tolerance
    assert len(runs[0]) == 4
    for rank in range(TP):
        for case, got in runs[rank].items():
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"rank {rank} {case}")
