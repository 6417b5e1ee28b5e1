"""Dense weights whose rows lie further apart than their length (padded_rows.py): every native
kernel that reads a dense weight (the matrix-vector products on each instruction-set variant,
the AMX decode tiles, the tiles' prompt product with its SiLU pair and packed hand-off) gives
the bits it gives for the same values stored contiguously; a weight whose rows are not
contiguous is refused with a clear error; `pad_rows` pads exactly the bfloat16 linears whose
rows are a multiple of 2 KB and that nothing else shares (a tied head, a view kept elsewhere), without changing a value; and a
padded model gives the unpadded one's logits bit for bit through both C++ layer loops, which
still take its steps (and with the kernels off, torch's products give the same logits too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from stallfree.runtime.model import cpu_kernels, padded_rows
from stallfree.runtime.model.compile import throwaway_batch
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model
from stallfree.runtime.model.padded_rows import is_padded, pad_rows, rows_contiguous
from tests.hf_models import make_llama
from tests.model.native_util import VARIANTS, OpCalls, needs_amx, needs_kernels, set_isa


def padded(w: torch.Tensor, extra: int) -> torch.Tensor:
    """`w`'s values as a view of a wider buffer, `extra` values (filled with garbage) past each
    row, so a kernel that reads past a row or ignores the stride gives other numbers."""
    n, k = w.shape
    wide = torch.full((n, k + extra), 3.0e4, dtype=w.dtype)
    wide[:, :k] = w
    view = wide[:, :k]
    assert not view.is_contiguous() and rows_contiguous(view)
    return view


def weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


# each variant this CPU has, and the AVX-512 one again with the AMX tiles where they are in use
ROUTES = [(isa, False) for isa in VARIANTS] + ([("avx512", True)] if cpu_kernels.amx() else [])


@needs_kernels
@pytest.mark.parametrize(("isa", "amx"), ROUTES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matrix_vector_kernels_read_padded_rows_as_contiguous_ones(
    isa: str, amx: bool, dtype: torch.dtype, restore_variant: None
) -> None:
    set_isa(isa)
    if amx:
        assert torch.ops.stallfree.set_amx(True)
    for n, k in [(48, 1024), (37, 96), (64, 2048)]:
        w = weight(n, k, dtype, n + k)
        bias = torch.randn(n)
        for extra in (32, 7):
            wp = padded(w, extra)
            for m in (1, 2, 3, 5, 8, 16):
                x = torch.randn(m, k).to(dtype)
                ref = torch.ops.stallfree.linear(x, w, bias)
                assert torch.equal(torch.ops.stallfree.linear(x, wp, bias), ref), (n, k, extra, m)
    # a group mixing padded and contiguous weights, as q/k/v of an unstacked model
    ws = [weight(64, 1024, dtype, s) for s in range(3)]
    for m in (1, 4, 16):
        x = torch.randn(m, 1024).to(dtype)
        ref = torch.ops.stallfree.linear_group(x, ws)
        mixed = [padded(ws[0], 32), ws[1], padded(ws[2], 5)]
        assert torch.equal(torch.ops.stallfree.linear_group(x, mixed), ref)


@needs_amx
def test_the_prompt_product_reads_padded_rows_as_contiguous_ones(tiles: None) -> None:
    op = torch.ops.stallfree.linear_bf16_prompt
    # k = 4096 at 256 rows is past the resident walk (the parked one, k in blocks)
    for n, k, rows in [(64, 1024, (17, 64, 200)), (128, 4096, (33, 256))]:
        w = weight(n, k, torch.bfloat16, k)
        bias = torch.randn(n)
        wp = padded(w, 32)
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            assert torch.equal(op(x, wp, bias), op(x, w, bias)), (n, k, m)
            # a stacked gate/up pair's SiLU epilogue, and its packed hand-off to the next product
            assert torch.equal(op(x, wp, bias, True), op(x, w, bias, True))
            packed = op(x, wp, None, True, True)
            assert torch.equal(packed, op(x, w, None, True, True))
            down = weight(32, n // 2, torch.bfloat16, 1)
            assert torch.equal(
                op(packed, padded(down, 32), None, False, False, m),
                op(packed, down, None, False, False, m),
            )


@needs_kernels
def test_a_weight_without_contiguous_rows_is_refused() -> None:
    x = torch.randn(4, 64).bfloat16()
    columns = torch.randn(64, 32).bfloat16().t()  # [32, 64] with rows strided
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.stallfree.linear(x, columns, None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.stallfree.linear_group(x, [torch.randn(16, 64).bfloat16(), columns])
    overlapping = torch.randn(64 * 32).bfloat16().as_strided((32, 64), (16, 1))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.stallfree.linear(x, overlapping, None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.stallfree.linear_bf16_prompt(torch.randn(40, 64).bfloat16(), columns, None)
    assert not rows_contiguous(columns) and not rows_contiguous(overlapping)


def test_pad_rows_pads_unshared_bfloat16_rows_of_a_multiple_of_2_kb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Module()
        m.wide = nn.Linear(1024, 48, bias=True, dtype=torch.bfloat16)  # 2 KB rows
        m.down = nn.Linear(4096, 16, bias=False, dtype=torch.bfloat16)  # 8 KB rows
        m.narrow = nn.Linear(576, 48, dtype=torch.bfloat16)  # 1152-byte rows
        m.f32 = nn.Linear(1024, 48)  # float32
        m.embed = nn.Embedding(32, 1024, dtype=torch.bfloat16)
        m.head = nn.Linear(1024, 32, bias=False, dtype=torch.bfloat16)
        m.head.weight = m.embed.weight  # tied
        m.viewed = nn.Linear(1024, 32, bias=False, dtype=torch.bfloat16)
        m.viewed.halves = [m.viewed.weight[:16], m.viewed.weight[16:]]  # its storage shared
        return m.requires_grad_(False)

    m, ref = model(), model()
    assert pad_rows(m) == 2
    assert is_padded(m.wide.weight) and is_padded(m.down.weight)
    assert m.wide.weight.stride() == (1024 + 32, 1)
    assert not any(is_padded(x.weight) for x in (m.narrow, m.f32, m.embed, m.head, m.viewed))
    assert m.head.weight is m.embed.weight
    for name, p in m.named_parameters():
        assert torch.equal(p, dict(ref.named_parameters())[name]), name
    # the padding itself is zeros, in the same storage
    wide = torch.empty(0, dtype=torch.bfloat16).set_(m.wide.weight.untyped_storage())
    assert torch.count_nonzero(wide.view(48, 1056)[:, 1024:]) == 0
    x = torch.randn(3, 1024).bfloat16()
    assert torch.equal(m.wide(x), ref.wide(x))

    monkeypatch.setenv("STALLFREE_PAD_WEIGHT_ROWS", "0")
    assert not padded_rows.enabled()
    assert pad_rows(model()) == 0


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2 KB rows (hidden 1024) and 4 KB ones (the down projection's 2048), untied head
    return make_llama(
        tmp_path_factory.mktemp("padded"),
        hidden_size=1024,
        intermediate_size=2048,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize(
    "mode, lens, new",
    [
        (ForwardMode.EXTEND, [40], 40),  # the prompt loop, on the tiles where the CPU has them
        (ForwardMode.EXTEND, [200], 200),
        (ForwardMode.DECODE, [57], 1),  # the decode loop, one row
        (ForwardMode.DECODE, [30, 61, 9, 44], 1),  # four rows (the decode tiles with AMX)
    ],
)
def test_a_padded_model_gives_the_same_logits_through_both_loops(
    wide_llama: Path, mode: ForwardMode, lens: list[int], new: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = {}
    for pad in ("0", "1"):
        monkeypatch.setenv("STALLFREE_PAD_WEIGHT_ROWS", pad)
        loaded = load_model(str(wide_llama), "bfloat16", torch.device("cpu"), 0)
        count = sum(is_padded(p) for p in loaded.model.parameters())
        # 2 layers x (q/k/v, o, gate/up, down) and the head
        assert count == (9 if pad == "1" else 0)
        fb = throwaway_batch(loaded, mode, lens, new)
        fb.input_ids = torch.randint(
            0, 256, fb.input_ids.shape, generator=torch.Generator().manual_seed(1)
        )
        with OpCalls() as ops:
            logits = loaded.model(fb)
        loop = (
            "stallfree.prefill_layers" if mode == ForwardMode.EXTEND else "stallfree.decode_layers"
        )
        results[pad] = (logits, ops.calls.count(loop))
    assert torch.equal(results["0"][0], results["1"][0])
    # padding changes no step's route: the loops take what they took (a bfloat16 prompt's loop
    # needs the AMX tiles, the decode loop only the kernels)
    assert results["1"][1] == results["0"][1]
    if cpu_kernels.available() and (mode == ForwardMode.DECODE or cpu_kernels.amx()):
        assert results["1"][1] == 1
