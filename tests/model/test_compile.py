"""runtime.torch_compile: the decoder layers compiled at start-up (two graphs shared by every
layer, a dynamic token count), outputs close to the eager model's, and no recompilation while
serving batches of every size."""

from __future__ import annotations

import pytest
import torch

from stallfree import Engine
from tests.engine_util import engine_config, random_prompts, run_greedy

pytestmark = pytest.mark.slow  # inductor compiles C++ on first use: tens of seconds


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


async def _serve(cfg, prompts):  # type: ignore[no-untyped-def]
    async with Engine(cfg) as engine:
        compiled_at_start = _graphs()
        results = await run_greedy(engine, prompts, 12)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        return results, compiled_at_start, _graphs()


async def test_compiled_layers_serve_every_batch_size_without_recompiling() -> None:
    torch._dynamo.reset()
    prompts = random_prompts(12, seed=5)  # 3 to 60 tokens: prefills and decode batches of 1-12
    compiled, at_start, at_end = await _serve(
        engine_config("tiny", runtime={"torch_compile": True}), prompts
    )
    assert at_start >= 2  # compiled before the first request
    assert at_end == at_start, "serving recompiled"
    eager, _, _ = await _serve(engine_config("tiny"), prompts)
    # inductor may sum in another order than eager; on this model the greedy tokens agree
    same = sum(a == b for a, b in zip(compiled, eager, strict=True))
    assert same >= len(prompts) - 1, (compiled, eager)


async def test_torch_compile_with_worker_processes_is_refused() -> None:
    cfg = engine_config("tiny", runtime={"torch_compile": True, "worker": "process"})
    with pytest.raises(ValueError, match="in-process model only"):
        async with Engine(cfg):
            pass


async def test_compiled_layers_beside_prepacked_prompt_weights() -> None:
    """`--prepack-prompt-weights` with torch.compile: the traced layers never touch the opaque
    oneDNN copy (it would not pass tracing) and serve prompts past its row limit, compiling
    exactly the graphs that the same bfloat16 model without the copy compiles."""
    from stallfree.runtime.model import native_layers

    long = [(7 * i) % 250 + 3 for i in range(native_layers.PREPACKED_MIN_ROWS + 40)]
    prompts = [*random_prompts(4, seed=5), long]
    graphs = {}
    for prepack in (True, False):
        torch._dynamo.reset()
        before = _graphs()  # the counter runs on over resets
        model = {"dtype": "bfloat16", "prepack_prompt_weights": prepack}
        results, at_start, at_end = await _serve(
            engine_config("tiny", model=model, runtime={"torch_compile": True}), prompts
        )
        assert [len(r) for r in results] == [12] * len(prompts)
        graphs[prepack] = (at_start - before, at_end - at_start)
    assert graphs[True] == graphs[False]
