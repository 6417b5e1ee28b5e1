"""Tensor-parallel Llama/Qwen2 over gloo: two spawned ranks against tp_size=1 and transformers.

One spawn runs every model (spawning costs seconds); each rank writes its logits, greedy tokens
and collective figures to a file that the test process compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from stallfree.runtime.model import ModelLoadError, load_model
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.loader import check_tensor_parallel, read_arch
from stallfree.runtime.model.parallel import (
    CommStats,
    TPGroup,
    kv_head_range,
    local_heads,
    local_kv_heads,
    shard_range,
    validate_tp,
)
from tests.hf_models import hf_logits, make_llama, make_qwen2
from tests.model_harness import CPU, PROMPT_A, PROMPT_B
from tests.parallel.tp_harness import (
    ATOL,
    DECODE_STEPS,
    LOGIT_POSITIONS,
    TP,
    param_shapes,
    run_greedy,
    spawn_ranks,
)
from tests.parallel.tp_harness import model_dirs as build_dirs

# name -> (builder, overrides); 4 query heads everywhere
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    # 2 KV heads split 1 + 1; Llama's attention_bias also biases o_proj (row-parallel bias)
    "llama_kv2_obias": (make_llama, {"attention_bias": True}),
    # 1 KV head replicated on both ranks; tied embeddings; odd vocab and intermediate sizes
    # (the last rank's vocab and MLP shards are zero-padded)
    "llama_kv1_tied_odd": (
        make_llama,
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "vocab_size": 263,
            "intermediate_size": 129,
        },
    ),
    # q/k/v biases sliced with the heads; 1 KV head replicated
    "qwen2_kv1": (make_qwen2, {"num_key_value_heads": 1}),
    # 2 KV heads split, tied embeddings
    "qwen2_kv2_tied": (make_qwen2, {"tie_word_embeddings": True}),
}


# cases also run fused and quantized (int8) at both sizes: row-parallel layers (o_proj with
# its bias, down_proj) on the quantized matmul, padded shards, a tied output kept dense
QUANTIZED_CASES = ("llama_kv2_obias", "llama_kv1_tied_odd")


@pytest.fixture(scope="module", autouse=True)
def _weight_only_int8() -> Any:
    """The quantized cases compare tp=2 with tp=1 to the weight quantization's noise; with the
    native W8A8 kernels each size also quantises its activations, in blocks that a shard of an
    odd width (no multiple of 32: the weight-only path) does not share, which adds that noise
    on top. Both sizes (this process and the spawned ranks) run weight-only here; the W8A8
    kernel itself is checked against its emulation in tests/model/test_native_kernels.py."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STALLFREE_QUANT_ACTIVATIONS", "0")
        yield


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_dirs(CASES, tmp_path_factory.mktemp("tp_models"))


# ---------------------------------------------------------------------------- the run


def _work(tp: TPGroup, dirs: dict[str, str]) -> dict[str, Any]:
    """On each rank: every case's greedy run, shard shapes, collective figures and local KV
    heads; the quantized cases fused and int8 on this rank's shards."""
    results: dict[str, Any] = {}
    for name, path in dirs.items():
        before = tp.stats.snapshot()
        loaded = load_model(path, "float32", CPU, 0, tp=tp)
        run = run_greedy(loaded)
        run["shapes"] = param_shapes(path, tp)
        run["comm"] = tp.stats.delta(before).as_dict()
        run["kv_heads"] = loaded.local_num_kv_heads
        results[name] = run
    for name in QUANTIZED_CASES:
        loaded = load_model(dirs[name], "float32", CPU, 0, tp=tp, quantization="int8")
        run = run_greedy(loaded)
        layer = loaded.model.model.layers[0]
        run["kinds"] = [
            type(m).__name__
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj)
        ]
        results[f"{name}:int8"] = run
    return results


@pytest.fixture(scope="module")
def tp_runs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Each rank's results for every case (and the tiny preset), from one spawn."""
    dirs = {name: str(path) for name, path in model_dirs.items()} | {"tiny": "tiny"}
    return spawn_ranks(_work, dirs, tmp_path_factory.mktemp("tp_out"))


# ---------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CASES, "tiny"])
def test_tp2_matches_tp1(name: str, tp_runs: list[Any], model_dirs: dict[str, Path]) -> None:
    path = "tiny" if name == "tiny" else str(model_dirs[name])
    ref = run_greedy(load_model(path, "float32", CPU, 0))
    for rank, runs in enumerate(tp_runs):
        run = runs[name]
        assert run["tokens"] == ref["tokens"], f"rank {rank}"
        assert len(run["logits"]) == len(ref["logits"]) == DECODE_STEPS + 1
        for got, want in zip(run["logits"], ref["logits"], strict=True):
            assert got.shape == want.shape  # the full vocab, padding dropped
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # every rank ends with the same full logits
    for a, b in zip(tp_runs[0][name]["logits"], tp_runs[1][name]["logits"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED_CASES)
def test_tp2_fused_and_quantized_is_close_to_tp1(
    name: str, tp_runs: list[Any], model_dirs: dict[str, Path]
) -> None:
    """Each rank quantizes its own shard: the column-parallel rows as tp=1 does, the
    row-parallel ones with a scale per half row, so the two sizes agree to quantization noise,
    not bit for bit."""
    ref = run_greedy(load_model(str(model_dirs[name]), "float32", CPU, 0, quantization="int8"))
    dense = run_greedy(load_model(str(model_dirs[name]), "float32", CPU, 0))["logits"][0]
    # tp=1's own quantization noise: the largest distance of its logits from float32's. Each
    # size quantizes on its own (other scales for the row-parallel halves), so the two are two
    # draws of that noise and lie within twice it of each other; a shard scaled wrongly is off
    # by the logits' whole spread. (A fixed 0.1 x the logits' spread held on a Zen 4 and missed
    # on a Zen 3 with the kernels on or off: 0.107 there, whose float32 noise alone is 0.096.)
    noise = (ref["logits"][0] - dense).abs().max().item()
    assert 0 < noise < 0.2 * dense.std().item()
    for runs in tp_runs:
        run = runs[f"{name}:int8"]
        assert run["kinds"] == ["Int8Linear", "Int8Linear", "Int8Linear"]
        # the first forward (the prefill) sees the same tokens at both sizes
        got, want = run["logits"][0], ref["logits"][0]
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 2 * noise
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(
        tp_runs[0][f"{name}:int8"]["logits"], tp_runs[1][f"{name}:int8"]["logits"], strict=True
    ):
        assert torch.equal(a, b)  # every rank ends with the same full logits


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_transformers(
    name: str, tp_runs: list[Any], model_dirs: dict[str, Path]
) -> None:
    run = tp_runs[0][name]
    prefill = run["logits"][0]
    for row, prompt in enumerate((PROMPT_A, PROMPT_B)):
        gen = run["tokens"][row]
        want = hf_logits(model_dirs[name], prompt + gen[:-1])
        got = torch.stack([prefill[row]] + [step[row] for step in run["logits"][1:]])
        torch.testing.assert_close(got, want[len(prompt) - 1 :], atol=ATOL, rtol=0)
        assert gen == want[len(prompt) - 1 :].argmax(-1).tolist()
    # the extra prompt rows (prompt logprobs) follow the last tokens' rows
    torch.testing.assert_close(
        prefill[2], hf_logits(model_dirs[name], PROMPT_A)[2], atol=ATOL, rtol=0
    )
    b_pos = LOGIT_POSITIONS[1] - len(PROMPT_A)
    torch.testing.assert_close(
        prefill[3], hf_logits(model_dirs[name], PROMPT_B)[b_pos], atol=ATOL, rtol=0
    )


@pytest.mark.slow
def test_collective_figures(tp_runs: list[Any]) -> None:
    """Per forward: an all-reduce for the embedding and two per layer, one logits all-gather."""
    layers, hidden, vocab = 2, 64, 260
    forwards = DECODE_STEPS + 1
    tokens = len(PROMPT_A) + len(PROMPT_B) + 2 * DECODE_STEPS  # embedded rows, all forwards
    for runs in tp_runs:
        comm = CommStats(**runs["llama_kv2_obias"]["comm"])
        assert comm.all_reduce_calls == forwards * (1 + 2 * layers)
        assert comm.all_reduce_bytes == tokens * hidden * 4 * (1 + 2 * layers)
        assert comm.all_gather_calls == forwards
        rows = 4 + 2 * DECODE_STEPS  # logits rows: 2 last + 2 extra prompt rows, then 2 a step
        assert comm.all_gather_bytes == rows * (vocab // TP) * 4
        assert comm.all_reduce_seconds > 0 and comm.all_gather_seconds > 0


@pytest.mark.slow
def test_rank_parameters_are_shards(tp_runs: list[Any]) -> None:
    d, hidden = 16, 64
    for rank, runs in enumerate(tp_runs):
        shapes = runs["llama_kv2_obias"]["shapes"]
        attn = "model.layers.0.self_attn"
        assert shapes[f"{attn}.q_proj.weight"] == (4 // TP * d, hidden)
        assert shapes[f"{attn}.k_proj.weight"] == (2 // TP * d, hidden)
        assert shapes[f"{attn}.o_proj.weight"] == (hidden, 4 // TP * d)
        assert shapes[f"{attn}.o_proj.bias"] == (hidden,)  # replicated, added once
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128 // TP, hidden)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (hidden, 128 // TP)
        assert shapes["model.embed_tokens.weight"] == (260 // TP, hidden)
        assert shapes["lm_head.weight"] == (260 // TP, hidden)
        assert runs["llama_kv2_obias"]["kv_heads"] == 1
        odd = runs["llama_kv1_tied_odd"]["shapes"]
        assert odd[f"{attn}.k_proj.weight"] == (d, hidden)  # the one KV head, replicated
        assert odd["model.embed_tokens.weight"] == (132, hidden)  # ceil(263 / 2), padded
        assert odd["model.layers.0.mlp.up_proj.weight"] == (65, hidden)  # ceil(129 / 2)
        assert "lm_head.weight" not in odd
        assert runs["llama_kv1_tied_odd"]["kv_heads"] == 1, f"rank {rank}"
        assert runs["qwen2_kv1"]["shapes"][f"{attn}.q_proj.bias"] == (4 // TP * d,)


@pytest.mark.usefixtures("float32_apart")
def test_shards_hold_the_checkpoint_slices(model_dirs: dict[str, Path]) -> None:
    """Loading needs no process group: each rank's tensors are the right rows/columns."""
    path = model_dirs["llama_kv1_tied_odd"]
    full = load_file(str(path / "model.safetensors"))
    d = 16
    attn = "model.layers.1.self_attn"
    for rank in range(TP):
        loaded = load_model(str(path), "float32", CPU, 0, tp=TPGroup(rank, TP))
        params = dict(loaded.model.named_parameters())
        q = full[f"{attn}.q_proj.weight"]
        assert torch.equal(params[f"{attn}.q_proj.weight"], q[rank * 2 * d : (rank + 1) * 2 * d])
        assert torch.equal(params[f"{attn}.k_proj.weight"], full[f"{attn}.k_proj.weight"])
        o = full[f"{attn}.o_proj.weight"]
        assert torch.equal(params[f"{attn}.o_proj.weight"], o[:, rank * 2 * d : (rank + 1) * 2 * d])
        start, end = shard_range(263, rank, TP)
        emb = params["model.embed_tokens.weight"]
        assert torch.equal(emb[: end - start], full["model.embed_tokens.weight"][start:end])
        assert not emb[end - start :].any()  # padding rows are zero
        s0, s1 = shard_range(129, rank, TP)
        down = params["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(
            down[:, : s1 - s0], full["model.layers.1.mlp.down_proj.weight"][:, s0:s1]
        )
        assert loaded.kv_cache_shape().num_kv_heads == 1
        assert loaded.local_num_heads == 2


def _arch(heads: int, kv_heads: int) -> ModelArchConfig:
    return ModelArchConfig(
        vocab_size=260,
        hidden_size=heads * 16,
        intermediate_size=128,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
    )


def test_kv_head_rule() -> None:
    # split: 8 KV heads over 4 ranks, 2 each, in order
    arch = _arch(16, 8)
    assert [kv_head_range(arch, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert local_heads(arch, 4) == 4 and local_kv_heads(arch, 4) == 2
    # replicated: 2 KV heads over 4 ranks; ranks 0-1 read head 0, ranks 2-3 head 1
    arch = _arch(8, 2)
    assert [kv_head_range(arch, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert local_kv_heads(arch, 4) == 1 and local_kv_heads(arch, TPGroup()) == 2
    # each rank's query heads all read the KV head it holds
    group = arch.num_heads // arch.num_kv_heads
    for r in range(4):
        h0 = r * local_heads(arch, 4)
        kv0, _ = kv_head_range(arch, r, 4)
        assert {h // group for h in range(h0, h0 + 2)} == {kv0}


def test_bad_head_counts_are_clear_errors(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"tensor-parallel size 3 .*num_attention_heads=4"):
        load_model(str(model_dirs["llama_kv2_obias"]), "float32", CPU, 0, tp=TPGroup(0, 3))
    with pytest.raises(ModelLoadError, match=r"num_attention_heads=4"):
        load_model("tiny", "float32", CPU, 0, tp=TPGroup(0, 3))
    with pytest.raises(ModelLoadError, match=r"num_key_value_heads=3"):
        validate_tp(_arch(6, 3), 2)
    with pytest.raises(ModelLoadError, match=r"num_key_value_heads=3 must divide .* size 8"):
        validate_tp(_arch(24, 3), 8)
    validate_tp(_arch(12, 3), 6)  # 3 KV heads, each on 2 of 6 ranks


def test_gguf_with_tp_is_a_clear_error(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="not supported with tensor parallelism"):
        load_model(str(gguf), "float32", CPU, 0, tp=TPGroup(0, 2))
    with pytest.raises(ModelLoadError, match=r"not supported with tensor parallelism.*tp_size=2"):
        check_tensor_parallel(str(gguf), 2)
    check_tensor_parallel(str(gguf), 1)  # nothing to check (and nothing read) at size 1


def test_check_before_loading(model_dirs: dict[str, Path]) -> None:
    """What a launcher checks before it starts any worker: shapes from config.json only."""
    path = str(model_dirs["llama_kv1_tied_odd"])
    arch = read_arch(path)
    assert (arch.num_heads, arch.num_kv_heads, arch.vocab_size) == (4, 1, 263)
    assert local_kv_heads(arch, 2) == 1 and local_kv_heads(arch, 4) == 1
    check_tensor_parallel(path, 2)
    check_tensor_parallel(path, 4)
    with pytest.raises(ModelLoadError, match=r"num_attention_heads=4"):
        check_tensor_parallel(path, 8)
    assert read_arch("bench-cpu").num_kv_heads == 4
    check_tensor_parallel("bench-cpu", 4)
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        check_tensor_parallel(str(model_dirs["llama_kv1_tied_odd"] / "missing"), 2)


def test_size_one_group_never_touches_distributed() -> None:
    tp = TPGroup()
    t = torch.ones(3)
    assert tp.all_reduce(t) is t
    assert tp.all_gather(t, 0) is t
    assert tp.stats == CommStats()
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TPGroup(2, 2)
