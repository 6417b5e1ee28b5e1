"""The prompt's layer loop in C++ inside the engine: prompts, one with a cached prefix, give the
same greedy tokens with the loop on as with it off (the Python loop), the loop takes their
prefills where the bfloat16 prompt products run (the AMX tiles, or the AVX-512 variant without
them) and on any CPU with the kernels (float32), and every pool is full again afterwards; with mixed
steps on, the steps that carry running streams' decode rows with a prompt's chunk take it too,
with the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.runtime.model import cpu_kernels, native_layers, native_prompt_loop
from stallfree.runtime.model.attention import bf16_prompt_native, one_token_tail
from tests.engine_util import engine_config, random_prompts
from tests.hf_models import TILES_SHAPE, make_llama

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels unavailable here"
)


def _bf16_loop() -> bool:
    """Whether a bfloat16 prompt takes the loop here: its products on `linear_bf16_prompt`, its
    attention on the native prompt op."""
    dim = TILES_SHAPE["hidden_size"] // TILES_SHAPE["num_attention_heads"]
    return native_layers.prompt_product_max_rows() > 0 and bf16_prompt_native(dim)


async def _generate(
    path: Path, loop: bool, monkeypatch: pytest.MonkeyPatch, dtype: str = "bfloat16"
) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens, one request at a time, and how many steps the loop took."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1" if loop else "0")
    taken = 0
    run = native_prompt_loop.run

    def counted(*args: Any) -> Any:
        nonlocal taken
        out = run(*args)
        taken += out is not None
        return out

    monkeypatch.setattr(native_prompt_loop, "run", counted)
    base = random_prompts(1, seed=4, lo=40, hi=40)[0]
    # the third shares the first's 40 tokens: its prefill attends over a cached prefix
    prompts = [base, random_prompts(1, seed=5, lo=70, hi=70)[0], base + [7, 9, 11] * 8]
    cfg = engine_config(str(path), model={"dtype": dtype})
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    async with Engine(cfg) as engine:
        results = [await engine.complete(p, params) for p in prompts]
        await engine.wait_idle()
        assert results[2].cached_tokens >= 32  # the prefix cache served the first's tokens
        assert engine.pool_usage().all_free
    return [r.token_ids for r in results], taken


async def test_the_loop_gives_the_python_loops_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_llama(tmp_path, **TILES_SHAPE)
    python, off = await _generate(path, False, monkeypatch)
    looped, taken = await _generate(path, True, monkeypatch)
    assert off == 0
    assert looped == python
    # every prompt's prefill of more rows than the matrix-vector kernels take (the third's 24
    # new tokens after its cached 40 included where the tiles take 17 rows and more)
    dense = native_layers.dense_max_rows(torch.bfloat16)
    assert taken == (sum(new > dense for new in (40, 70, 24)) if _bf16_loop() else 0)


async def test_a_float32_model_takes_the_loop_with_the_python_loops_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float32 needs no tiles: torch's own products, the prompt attention's vector path
    path = make_llama(tmp_path, **TILES_SHAPE)
    python, off = await _generate(path, False, monkeypatch, "float32")
    looped, taken = await _generate(path, True, monkeypatch, "float32")
    assert off == 0
    assert looped == python
    assert taken == 3


async def _mixed(
    path: Path, loop: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], int, int]:
    """test_mixed_chunk's workload (three streams decoding while two long prompts are
    prefilled in chunks, their decode rows mixed in) on a bfloat16 model, in steps of up to 40
    rows: the outputs, the mixed steps with two or more decode rows and more rows than the
    matrix-vector kernels take, and how many of those the loop took."""
    from tests.engine.test_mixed_chunk import run_workload

    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1" if loop else "0")
    tails = taken = 0
    run = native_prompt_loop.run

    def counted(*args: Any) -> Any:
        nonlocal tails, taken
        out = run(*args)
        h, fb = args[2], args[4]
        dense = native_layers.dense_max_rows(torch.bfloat16)  # the matrix-vector kernels'
        if one_token_tail(fb.extend_lens_cpu) >= 2 and h.shape[0] > dense:
            tails += 1
            taken += out is not None
        return out

    monkeypatch.setattr(native_prompt_loop, "run", counted)
    result = await run_workload(
        str(path), True, True, True, model={"dtype": "bfloat16"},
        scheduler={"chunked_prefill_size": 40, "max_prefill_tokens": 48},
    )  # fmt: skip
    assert result.counters.mixed_batches > 0
    return result.outputs, tails, taken


async def test_mixed_steps_take_the_loop_with_their_decode_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_llama(tmp_path, **TILES_SHAPE)
    python, tails, off = await _mixed(path, False, monkeypatch)
    looped, looped_tails, taken = await _mixed(path, True, monkeypatch)
    assert off == 0
    assert looped == python
    assert tails == 0, tails  # off: never asked
    if native_layers.dense_max_rows(torch.bfloat16) < 40:
        # the workload has such steps wherever a step of up to 40 rows is past the
        # matrix-vector kernels (on the AVX2 variant they take every row count: none is)
        assert looped_tails > 0, (looped_tails, taken)
    # every mixed step with a decode tail, where the prompt products run
    assert taken == (looped_tails if _bf16_loop() else 0)
