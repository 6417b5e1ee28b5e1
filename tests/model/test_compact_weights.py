"""`--compact-decode-weights` (`model.compact_decode_weights`): each dense bfloat16 linear keeps
its weight in 12 bits a value as well (csrc/compact_bf16.cpp), losslessly, and decode rows (up
to `COMPACT_MAX_ROWS`) multiply that form with the dense kernel's bits; a row that does not
fit in it is read from the dense weight; prompts keep the dense weight; the flag reaches the
loader and the worker processes, the C++ layer loop and a tied output matrix; each variant of
the kernels (AVX-512, AVX2) has its own product, with its own dense kernel's bits; without the
kernels nothing is compacted."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from stallfree.runtime.model import cpu_kernels, native_layers, native_loop
from tests.model.native_util import OpCalls, each_isa, needs_kernels, set_isa


def use_variant(isa: str) -> None:
    """The variant `isa` without the AMX tiles: the dense kernel whose bits that variant's
    compact product gives (the tiles, where a CPU has them, take 3 rows and more with other
    sums)."""
    set_isa(isa)
    torch.ops.stallfree.set_amx(False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def gaussian(n: int, k: int, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * scale).to(torch.bfloat16)


def unfit_row(k: int) -> torch.Tensor:
    """A bfloat16 row whose values take 20 high bytes besides zero's, more than a table holds: a
    high byte is the sign and the exponent's top 7 bits, so powers of 4 each take their own."""
    row = torch.full((k,), 0.01)
    row[:20] = torch.tensor([4.0**e for e in range(-10, 10)])
    return row.to(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("k", [64, 192, 576])
def test_a_weight_comes_back_bit_for_bit(k: int) -> None:
    w = gaussian(37, k)
    # zeros of both signs, subnormals, the smallest normal, and infinities
    special = torch.tensor(
        [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F80, 0xFF80], dtype=torch.int32
    )
    w.view(torch.int16)[5, :7] = special.to(torch.int16)
    codes, tables = torch.ops.stallfree.compact_bf16(w)
    assert codes.shape == (37, k + k // 2) and codes.dtype == torch.uint8
    assert tables.shape == (37, 16) and tables.dtype == torch.uint8
    fits = tables[:, 0] != 0xFF
    assert fits.sum() >= 30  # a Gaussian row spans about 15 powers of two
    back = torch.ops.stallfree.uncompact_bf16(codes, tables)
    assert torch.equal(bits(back[fits]), bits(w[fits]))
    assert torch.equal(bits(back[~fits]), torch.zeros_like(bits(w[~fits])))


@needs_kernels
def test_the_table_holds_the_rows_most_frequent_high_bytes() -> None:
    # one row: 1.0 (0x3F80) x 40, -0.5 (0xBF00) x 20, 0.25 (0x3E80) x 4; nothing else
    row = torch.zeros(64)
    row[:40], row[40:60], row[60:64] = 1.0, -0.5, 0.25
    codes, tables = torch.ops.stallfree.compact_bf16(row.to(torch.bfloat16)[None])
    # then bytes the row does not use, the lower first
    assert tables[0, :5].tolist() == [0x3F, 0xBF, 0x3E, 0x00, 0x01]
    # the row's bytes: 64 low bytes then 32 code bytes; value 0 (1.0) at position 0 is low
    # byte 0x80 and code 0 (0x3F), value 63 (0.25 = 0x3E80) at position 16 * 3 + 8 + 7 = 63,
    # its code 2 in the high nibble of code byte 31
    assert codes.shape == (1, 96)
    assert int(codes[0, 0]) == 0x80 and int(codes[0, 64]) & 0xF == 0
    assert int(codes[0, 63]) == 0x80 and int(codes[0, 64 + 31]) >> 4 == 2


@needs_kernels
def test_sixteen_high_bytes_fit_and_0xff_is_never_code_0() -> None:
    # 16 powers of 4 (16 high bytes, none of them zero's) fit; a 17th does not
    sixteen = torch.tensor([4.0**e for e in range(-8, 8)]).repeat(4)
    rows = torch.stack([sixteen, torch.cat([sixteen[:63], torch.tensor([4.0**9])])])
    _, tables = torch.ops.stallfree.compact_bf16(rows.to(torch.bfloat16))
    assert int(tables[0, 0]) != 0xFF and int(tables[1, 0]) == 0xFF
    # a row made mostly of negative NaNs (high byte 0xFF) fits, 0xFF at another code
    nan = torch.full((64,), 0xFFBF - 0x10000, dtype=torch.int16)  # a negative NaN
    nan[:8] = 0x3F80  # 1.0
    w = nan.view(torch.bfloat16)[None]
    codes, tables = torch.ops.stallfree.compact_bf16(w)
    assert int(tables[0, 0]) != 0xFF and 0xFF in tables[0].tolist()
    back = torch.ops.stallfree.uncompact_bf16(codes, tables)
    assert torch.equal(bits(back), bits(w))


@needs_kernels
@each_isa
def test_a_row_that_does_not_fit_is_marked_and_read_from_the_dense_weight(
    isa: str, restore_variant: None
) -> None:
    use_variant(isa)
    w = gaussian(9, 128)
    w[2] = unfit_row(128)
    codes, tables = torch.ops.stallfree.compact_bf16(w)
    assert int(tables[2, 0]) == 0xFF
    assert (tables[torch.arange(9) != 2, 0] != 0xFF).all()
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = torch.ops.stallfree.linear_compact(x, w, codes, tables, None)
    assert torch.equal(bits(got), bits(torch.ops.stallfree.linear(x, w, None)))


@needs_kernels
@each_isa
@pytest.mark.parametrize("k", [64, 128, 576])
@pytest.mark.parametrize("n", [1, 3, 4, 37, 64])
def test_products_are_the_dense_kernels_bits(
    n: int, k: int, isa: str, restore_variant: None
) -> None:
    """On each variant, against that variant's dense kernel: every row count from 1 to 16 (its
    tiles of 3 or 4 rows and past them), outputs past a tile of 4 weight rows, a bias or none,
    a weight whose rows lie further apart than its width (the padded layout), a row that does
    not fit."""
    use_variant(isa)
    g = torch.Generator().manual_seed(n * 1000 + k)
    wide = (torch.randn(n, k + 32, generator=g) * 0.05).to(torch.bfloat16)
    w = wide[:, :k]  # rows k + 32 values apart
    if n > 3:
        w[n // 2] = unfit_row(k)
    codes, tables = torch.ops.stallfree.compact_bf16(w)
    bias = torch.randn(n, generator=g)
    for rows in range(1, 17):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got = torch.ops.stallfree.linear_compact(x, w, codes, tables, b)
            want = torch.ops.stallfree.linear(x, w, b)
            assert got.shape == want.shape == (rows, n)
            assert torch.equal(bits(got), bits(want)), (rows, b is None)


@needs_kernels
def test_bad_inputs_are_refused_with_a_clear_error() -> None:
    ops = torch.ops.stallfree
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.compact_bf16(gaussian(4, 96))
    with pytest.raises(RuntimeError, match="must be a BFloat16"):
        ops.compact_bf16(gaussian(4, 64).float())
    w = gaussian(8, 64)
    codes, tables = ops.compact_bf16(w)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="codes must be"):
        ops.linear_compact(x, w, codes[:4], tables, None)
    with pytest.raises(RuntimeError, match="tables must be"):
        ops.linear_compact(x, w, codes, tables[:, :8].contiguous(), None)
    with pytest.raises(RuntimeError, match="expected bfloat16"):
        ops.linear_compact(x.float(), w, codes, tables, None)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_compact(torch.randn(2, 128).to(torch.bfloat16), w, codes, tables, None)


@needs_kernels
def test_the_fakes_match_the_ops() -> None:
    """torch.compile traces the ops through their fakes (cpu_kernel_fakes.py)."""
    w = gaussian(40, 64)
    codes, tables = torch.ops.stallfree.compact_bf16(w)
    x = torch.randn(3, 64).to(torch.bfloat16)
    cases = {
        "compact_bf16": (w,),
        "uncompact_bf16": (codes, tables),
        "linear_compact": (x, w, codes, tables, torch.randn(40)),
    }
    for name, args in cases.items():
        torch.library.opcheck(
            getattr(torch.ops.stallfree, name), args, test_utils=("test_schema", "test_faketensor")
        )


def bf16_linear(n: int, k: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(gaussian(n, k))
        if bias:
            layer.bias.copy_(gaussian(1, n, seed=1)[0])
    return layer


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_decode_rows_take_the_compact_form_and_prompts_the_dense_weight(bias: bool) -> None:
    plain = native_layers.NativeLinear.adopt(bf16_linear(96, 128, bias))
    compact = native_layers.NativeLinear.adopt(bf16_linear(96, 128, bias), compact=True)
    assert plain.compact_codes is None and compact.compact_codes is not None
    for rows in (1, 2, 3, 4, 5, 16, 200):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        with torch.inference_mode(), OpCalls() as calls:
            got = compact(x)
        with torch.inference_mode():
            want = plain(x)
        assert torch.equal(bits(got), bits(want))
        on_compact_form = "stallfree.linear_compact" in calls.native()
        assert on_compact_form is (rows <= native_layers.compact_max_rows()), rows


def test_each_variant_compacts_and_the_torch_path_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for isa in ("avx512", "avx2"):
        monkeypatch.setattr(cpu_kernels, "isa", lambda isa=isa: isa)
        assert native_layers.compact_applies(gaussian(8, 64))
    monkeypatch.setattr(cpu_kernels, "isa", lambda: None)
    assert not native_layers.compact_applies(gaussian(8, 64))


@needs_kernels
def test_only_bfloat16_weights_of_whole_blocks_of_64_are_compacted() -> None:
    assert native_layers.compact_applies(gaussian(8, 64))
    assert not native_layers.compact_applies(gaussian(8, 96))
    assert not native_layers.compact_applies(gaussian(8, 64).float())
    assert native_layers.compact_applies(gaussian(8, 128)[:, :64])  # rows apart: padded rows
    assert not native_layers.compact_applies(gaussian(64, 8).t())  # rows not contiguous


@needs_kernels
def test_the_loader_compacts_every_dense_linear_and_a_tied_head(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stallfree.runtime.model.loader import load_model
    from tests.hf_models import make_llama

    tied = str(make_llama(tmp_path, tie_word_embeddings=True))
    for path, head in (("tiny", False), (tied, True)):
        for on in (False, True):
            loaded = load_model(path, "bfloat16", torch.device("cpu"), 0, compact_decode_weights=on)
            layers = [
                m for m in loaded.model.modules() if isinstance(m, native_layers.NativeLinear)
            ]
            assert layers
            assert all((m.compact_codes is not None) is on for m in layers)
            assert (loaded.model.head_codes is not None) is (on and head)


def greedy_with(
    path: str, setting: str | bool, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], dict[native_loop.PlanKey, native_loop.Plan | None]]:
    """A bfloat16 engine's greedy outputs with `compact_decode_weights=setting`: every prompt
    at once, then the first alone (steps of several rows and of one), the pools checked back to
    full; and the C++ layer loop's plans it made, by row count."""
    from stallfree import Engine
    from tests.engine_util import engine_config, run_greedy

    async def run() -> tuple[list[list[int]], dict[native_loop.PlanKey, native_loop.Plan | None]]:
        cfg = engine_config(path, model={"dtype": "bfloat16", "compact_decode_weights": setting})
        async with Engine(cfg) as engine:
            out = await run_greedy(engine, prompts, new_tokens)
            out += await run_greedy(engine, prompts[:1], new_tokens)
            await engine.wait_idle()
            assert engine.pool_usage().all_free
            return out, dict(engine.core.loaded.model._loop_plans)

    return asyncio.run(run())


@needs_kernels
def test_greedy_output_is_the_same_and_the_layer_loop_takes_the_compact_form(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.engine_util import random_prompts
    from tests.hf_models import make_llama

    path = str(make_llama(tmp_path, tie_word_embeddings=True))
    # four streams together, then one alone: steps of 4 rows and of 1
    prompts = random_prompts(4, seed=3)
    plain, plain_plans = greedy_with(path, False, prompts, 12)
    compact, compact_plans = greedy_with(path, True, prompts, 12)
    assert compact == plain
    assert all(p is None or native_loop.COMPACT not in p.spec for p in plain_plans.values())
    # a plan per row count: the compact form up to compact_max_rows (the 4 rows' plan is past
    # it on the AVX2 variant, whose limit is 2)
    looped = [(key[0], p) for key, p in compact_plans.items() if p is not None]
    if native_loop.enabled():
        assert any(rows <= native_layers.compact_max_rows() for rows, _ in looped)
        for rows, p in looped:
            assert (native_loop.COMPACT in p.spec) is (rows <= native_layers.compact_max_rows())


def test_the_flag_sets_the_model_setting_and_reaches_the_workers() -> None:
    from stallfree.cli import build_parser
    from stallfree.entrypoints.cli import config_from_args
    from stallfree.runtime.execution.worker import worker_spec
    from tests.engine_util import engine_config

    parser = build_parser()

    def parsed(*flags: str) -> str:
        args = parser.parse_args(["serve", "--model", "x", *flags])
        return str(config_from_args(args).model.compact_decode_weights)

    assert parsed("--compact-decode-weights") == "beside"
    assert parsed("--compact-decode-weights", "only") == "only"
    assert parsed("--compact-decode-weights=off") == "off"
    assert parsed() == "auto"
    with pytest.raises(SystemExit):
        parsed("--compact-decode-weights", "half")
    for setting, mode in ((True, "beside"), (False, "off"), ("only", "only")):
        cfg = engine_config("tiny", model={"compact_decode_weights": setting})
        assert worker_spec(cfg, 64, 128).compact_decode_weights == mode
