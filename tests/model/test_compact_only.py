"""`--compact-decode-weights only` (compact_only.py): each dense bfloat16 linear but the output
matrix kept in its compact form alone. Decode rows multiply the form, prompts decode it a block
of rows at a time (`decompact_bf16`, `decompacted_product`), and every product keeps the dense
layer's bits; the rows that do not fit are the only dense values kept, in a mapping whose other
pages take no memory and which stays out of the huge pages' arena; the setting refuses what
reads dense weights (tensor parallelism, LoRA, torch.compile)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stallfree.runtime.model import compact_only, native_layers, native_loop
from tests.model.native_util import OpCalls, each_isa, needs_kernels
from tests.model.test_compact_weights import bits, gaussian, greedy_with, unfit_row, use_variant


def with_unfit_rows(n: int, k: int, rows: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    w = gaussian(n, k, seed)
    for r in rows:
        w[r] = unfit_row(k).roll(r)
    return w


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decompact_writes_a_block_of_rows_the_unfit_ones_from_the_weight(
    dtype: torch.dtype,
) -> None:
    w = with_unfit_rows(70, 192, (3, 41, 69))
    codes, tables = torch.ops.stallfree.compact_bf16(w)
    assert int((tables[:, 0] == compact_only.UNFIT).sum()) == 3
    # the unfit rows' values are read from the weight given, not from the codes
    sparse = compact_only.sparse_rows(w, tables)
    for start, rows in ((0, 70), (3, 39), (41, 1), (60, 10)):
        out = torch.full((rows, 192), 7.0, dtype=dtype)
        torch.ops.stallfree.decompact_bf16(codes, tables, sparse, start, out)
        assert torch.equal(bits(out.to(torch.bfloat16)), bits(w[start : start + rows]))


@needs_kernels
def test_decompact_refuses_bad_arguments() -> None:
    ops = torch.ops.stallfree
    w = gaussian(8, 64)
    codes, tables = ops.compact_bf16(w)
    with pytest.raises(RuntimeError, match="not within"):
        ops.decompact_bf16(codes, tables, w, 4, torch.empty(5, 64))
    with pytest.raises(RuntimeError, match="not within"):
        ops.decompact_bf16(codes, tables, w, -1, torch.empty(2, 64))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.decompact_bf16(codes, tables, w, 0, torch.empty(2, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.decompact_bf16(codes, tables, w, 0, torch.empty(2, 32))
    with pytest.raises(RuntimeError, match="codes must be"):
        ops.decompact_bf16(codes[:4], tables, w, 0, torch.empty(2, 64))


def _mapping_rss_kb(t: torch.Tensor) -> int:
    """The resident kB of the mapping that holds `t`'s first byte (/proc/self/smaps)."""
    ptr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@needs_kernels
def test_the_rows_that_fit_take_no_memory() -> None:
    # 4096 rows of 2048 values: 16 MB dense, two rows that do not fit (4 KB each); the others'
    # magnitudes span a few powers of two (a Gaussian row this long often spans too many)
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(4096, 2048, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
    w[10] = unfit_row(2048)
    w[3000] = unfit_row(2048)
    _, tables = torch.ops.stallfree.compact_bf16(w)
    assert (tables[:, 0] == compact_only.UNFIT).nonzero().flatten().tolist() == [10, 3000]
    sparse = compact_only.sparse_rows(w, tables)
    assert sparse.is_contiguous() and sparse.shape == w.shape
    assert torch.equal(bits(sparse[10]), bits(w[10])) and torch.equal(
        bits(sparse[3000]), bits(w[3000])
    )
    rest = torch.ones(4096, dtype=torch.bool)
    rest[[10, 3000]] = False
    assert int(sparse[rest].float().abs().sum()) == 0
    assert _mapping_rss_kb(sparse) <= 64  # the two rows' pages, not 16 MB


def test_a_tensor_marked_to_stay_is_not_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.runtime.memory import huge_pages
    from stallfree.runtime.model import padded_rows

    monkeypatch.setattr(padded_rows, "enabled", lambda: True)
    model = nn.Sequential(*(nn.Linear(1024, 64, dtype=torch.bfloat16) for _ in range(2)))
    huge_pages.stay_in_place(model[0].weight)
    assert padded_rows.pad_rows(model) == 1
    assert model[0].weight.stride() == (1024, 1) and model[1].weight.stride()[0] > 1024


def test_a_tensor_marked_to_stay_is_not_moved_to_huge_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stallfree.runtime.memory import huge_pages

    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    stays = model[0].weight
    huge_pages.stay_in_place(stays)
    before = (stays.data_ptr(), model[1].weight.data_ptr())
    assert huge_pages.move_to_huge_pages(model) > 0
    assert stays.data_ptr() == before[0]
    assert model[1].weight.data_ptr() != before[1]


def compact_only_layer(
    n: int, k: int, bias: bool, unfit: tuple[int, ...]
) -> tuple[nn.Linear, nn.Linear]:
    """A dense NativeLinear and the same layer kept only in its compact form."""
    w = with_unfit_rows(n, k, unfit, seed=n + k)
    layers = []
    for _ in range(2):
        layer = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w)
            if bias:
                layer.bias.copy_(torch.linspace(-1, 1, n))
        layers.append(layer)
    dense = native_layers.NativeLinear.adopt(layers[0])
    holder = nn.Module()
    holder.proj = native_layers.NativeLinear.adopt(layers[1])
    assert compact_only.keep_compact_only(holder) == n * k * 2
    return dense, holder.proj


@needs_kernels
@each_isa
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_gives_the_dense_layers_bits(isa: str, bias: bool) -> None:
    use_variant(isa)
    dense, only = compact_only_layer(96, 192, bias, unfit=(5, 50))
    assert only.compact_only and not dense.compact_only
    g = torch.Generator().manual_seed(1)
    limit = native_layers.compact_only_max_rows()
    for rows in (1, 2, 3, 4, 5, 17, limit, limit + 1, 300):
        x = torch.randn(rows, 192, generator=g).to(torch.bfloat16)
        with OpCalls() as calls:
            got = only(x)
        assert torch.equal(bits(got), bits(dense(x))), rows
        on_form = "stallfree.linear_compact" in calls.native()
        assert on_form is (rows <= limit), rows
        assert ("stallfree.decompact_bf16" in calls.native()) is (rows > limit), rows


@needs_kernels
def test_the_bfloat16_blocks_give_the_dense_layers_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # the route of a CPU that does not widen prompts to float32 (the AVX-512 variant), in
    # blocks of whole tiles of 16 rows, several blocks a weight
    monkeypatch.setattr(native_layers, "widens", lambda rows, dtype: False)
    monkeypatch.setattr(native_layers, "compact_only_max_rows", lambda: 2)
    monkeypatch.setattr(native_layers, "WIDEN_BLOCK_BYTES", 32 * 128 * 2)
    for n in (96, 90):  # 90: not whole tiles, one block
        dense, only = compact_only_layer(n, 128, True, unfit=(7,))
        g = torch.Generator().manual_seed(2)
        for rows in (3, 9, 40, 200):
            x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
            with OpCalls() as calls:
                got = only(x)
            blocks = calls.native().count("stallfree.decompact_bf16")
            assert blocks == (3 if n == 96 else 1), (n, rows)
            assert torch.equal(bits(got), bits(dense(x))), (n, rows)


@needs_kernels
def test_the_loader_keeps_only_the_compact_form_but_the_output_matrix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stallfree.runtime.model.loader import load_model
    from tests.hf_models import make_llama

    untied = str(make_llama(tmp_path, tie_word_embeddings=False))
    loaded = load_model(untied, "bfloat16", torch.device("cpu"), 0, compact_decode_weights="only")
    layers = {
        name: m
        for name, m in loaded.model.named_modules()
        if isinstance(m, native_layers.NativeLinear)
    }
    assert "lm_head" in layers and not layers["lm_head"].compact_only
    assert layers["lm_head"].compact_codes is not None  # its form beside it, for decode rows
    rest = [m for name, m in layers.items() if name != "lm_head"]
    assert rest and all(m.compact_only for m in rest)
    for m in rest:
        unfit = m.compact_tables[:, 0] == compact_only.UNFIT
        assert int(m.weight[~unfit].float().abs().sum()) == 0  # the dense values given back
    with pytest.raises(ValueError, match="off, beside or only"):
        load_model(untied, "bfloat16", torch.device("cpu"), 0, compact_decode_weights="half")


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_greedy_output_is_the_dense_models(tmp_path, tied: bool) -> None:  # type: ignore[no-untyped-def]
    from tests.engine_util import random_prompts
    from tests.hf_models import make_llama

    path = str(make_llama(tmp_path, tie_word_embeddings=tied))
    # prompts past linear_compact's rows (decoded a block at a time), and short ones
    prompts = random_prompts(3, seed=5, lo=150, hi=220) + random_prompts(2, seed=6)
    dense, _ = greedy_with(path, "off", prompts, 10)
    only, plans = greedy_with(path, "only", prompts, 10)
    assert only == dense
    if native_loop.enabled():
        looped = [p for p in plans.values() if p is not None]
        assert looped and all(native_loop.COMPACT in p.spec for p in looped)


def test_the_setting_refuses_what_reads_dense_weights() -> None:
    from stallfree.config.settings import StallfreeConfig

    assert (
        StallfreeConfig(model={"compact_decode_weights": True}).model.compact_decode_weights
        == "beside"
    )
    assert (
        StallfreeConfig(model={"compact_decode_weights": False}).model.compact_decode_weights
        == "off"
    )
    for other in (
        {"parallel": {"tp_size": 2}, "runtime": {"worker": "process"}},
        {"lora": {"enable_lora": True}},
        {"runtime": {"torch_compile": True}},
    ):
        with pytest.raises(ValueError, match="compact_decode_weights=only"):
            StallfreeConfig(model={"compact_decode_weights": "only"}, **other)
        StallfreeConfig(model={"compact_decode_weights": "beside"}, **other)


def test_auto_is_only_on_the_avx2_variant_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.runtime.model import cpu_kernels
    from stallfree.runtime.model.loader import compact_mode
    from stallfree.runtime.model.parallel import TPGroup

    for isa, mode in (("avx2", "only"), ("avx512", "off"), (None, "off")):
        monkeypatch.setattr(cpu_kernels, "isa", lambda isa=isa: isa)
        assert compact_mode("auto", "cpu", None) == mode, isa
        assert compact_mode("beside", "cpu", None) == "beside"
        assert compact_mode(True, "cpu", None) == "beside"
        assert compact_mode(False, "cpu", None) == "off"
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx2")
    assert compact_mode("auto", "cuda", None) == "off"
    assert compact_mode("auto", "cpu", TPGroup(0, 2)) == "off"
    assert compact_mode("auto", "cpu", TPGroup(0, 1)) == "only"
    with pytest.raises(ValueError, match="auto, off, beside or only"):
        compact_mode("half", "cpu", None)
    with pytest.raises(ValueError, match="runs on one rank"):
        compact_mode("only", "cpu", TPGroup(0, 2))


def test_the_config_leaves_auto_off_where_only_does_not_apply() -> None:
    from stallfree.config.settings import StallfreeConfig

    assert StallfreeConfig().compact_weights() == "auto"
    for other in (
        {"parallel": {"tp_size": 2}, "runtime": {"worker": "process"}},
        {"lora": {"enable_lora": True}},
        {"runtime": {"torch_compile": True}},
    ):
        assert StallfreeConfig(**other).compact_weights() == "off"
        assert (
            StallfreeConfig(model={"compact_decode_weights": "beside"}, **other).compact_weights()
            == "beside"
        )


def test_a_quantized_tied_embedding_gets_no_compact_head() -> None:
    # a GGUF's Q8_0 / Q4_1 tied output matrix (Int8Embedding) has no dense weight: the compact
    # form's head is skipped, not an AttributeError at load (auto is only on the AVX2 variant)
    from types import SimpleNamespace

    from stallfree.runtime.model.llama import LlamaForCausalLM

    model = SimpleNamespace(
        arch=SimpleNamespace(tie_word_embeddings=True),
        tied_head=nn.Linear(4, 4),
        model=SimpleNamespace(embed_tokens=nn.Module()),
    )
    assert LlamaForCausalLM.compact_tied_head(model) is False  # type: ignore[arg-type]
