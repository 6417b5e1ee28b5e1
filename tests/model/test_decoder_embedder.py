"""Decoder embedders: a tiny random Qwen3 and Llama on `--runner pooling`, against transformers'
final hidden states pooled the same way (Qwen3-Embedding's shape: last token, normalised)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.pooler import open_engine, runner_for
from stallfree.runtime.scheduled_pooler import ScheduledPoolingEngine
from tests.engine_util import engine_config
from tests.hf_models import make_gemma2, make_llama, make_qwen3

ROWS = [[5, 17, 99, 3, 250, 41, 7], [12, 200], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74]]


def _reference(path: Path, rows: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last_hidden_state of each row, run alone (no padding to get wrong)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([r])).last_hidden_state[0] for r in rows]


def _write_mean_pooling(path: Path) -> None:
    """sentence-transformers files asking for mean pooling and no normalisation."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )


async def _embed(path: Path, rows: list[list[int]], **model: object) -> torch.Tensor:
    engine = open_engine(engine_config(str(path), model={"runner": "pooling", **model}))
    assert isinstance(engine, ScheduledPoolingEngine)  # through the scheduler
    await engine.start()
    try:
        return (await engine.embed(rows)).outputs
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("make", [make_qwen3, make_llama])
async def test_last_token_normalised_equals_transformers(tmp_path: Path, make) -> None:
    path = make(tmp_path)
    ours = await _embed(path, ROWS)
    expected = torch.stack(
        [torch.nn.functional.normalize(h[-1], dim=-1) for h in _reference(path, ROWS)]
    )
    assert ours.shape == (3, 64)
    assert (ours - expected).abs().max().item() < 1e-4
    assert torch.allclose(ours.norm(dim=-1), torch.ones(3), atol=1e-5)


@pytest.mark.asyncio
async def test_mean_pooling_from_sentence_transformers_files(tmp_path: Path) -> None:
    path = make_qwen3(tmp_path)
    _write_mean_pooling(path)
    ours = await _embed(path, ROWS)
    expected = torch.stack([h.mean(dim=0) for h in _reference(path, ROWS)])
    assert (ours - expected).abs().max().item() < 1e-4
    # not normalised: the files have no Normalize module
    assert not torch.allclose(ours.norm(dim=-1), torch.ones(3), atol=1e-2)


def test_runner_rules_for_decoders(tmp_path: Path) -> None:
    path = str(make_qwen3(tmp_path))
    assert runner_for(engine_config(path)) == "generate"
    assert runner_for(engine_config(path, model={"runner": "pooling"})) == "pooling"


def test_a_family_with_layers_of_its_own_is_refused(tmp_path: Path) -> None:
    path = str(make_gemma2(tmp_path))
    with pytest.raises(ModelLoadError, match="layers of its own"):
        open_engine(engine_config(path, model={"runner": "pooling"}))
