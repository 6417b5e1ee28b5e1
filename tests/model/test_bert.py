"""The BERT encoder and its pooling against sentence-transformers (the real all-MiniLM-L6-v2)
and transformers (a tiny random BertModel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.model.bert import load_bert
from stallfree.runtime.model.pooling import finish, pool, read_pooling_config
from stallfree.runtime.text.tokenizer import HFTokenizer
from tests.minilm import matryoshka_copy, require_minilm

TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, again and again, until it is tired.",
    "a",
    "Embeddings map text to vectors; similar texts land close together.",
]


def _embed(path: Path, texts: list[str], dimensions: int | None = None) -> torch.Tensor:
    config = json.loads((path / "config.json").read_text())
    model = load_bert(path, config, torch.float32, torch.device("cpu"))
    pooling = read_pooling_config(path, config, model.cfg.hidden_size, "cls")
    tok = HFTokenizer(path)
    ids = [tok.encode(t) for t in texts]
    longest = max(len(i) for i in ids)
    batch = torch.tensor([i + [0] * (longest - len(i)) for i in ids])
    mask = torch.tensor([[True] * len(i) + [False] * (longest - len(i)) for i in ids])
    with torch.inference_mode():
        return finish(pool(model(batch, mask), mask, pooling.mode), pooling, dimensions)


def test_minilm_config() -> None:
    path = require_minilm()
    config = json.loads((path / "config.json").read_text())
    pooling = read_pooling_config(path, config, 384, "cls")
    assert (pooling.mode, pooling.normalize, pooling.dimension) == ("mean", True, 384)
    assert (pooling.matryoshka, pooling.max_seq_length) == (False, 256)


def test_minilm_equals_sentence_transformers() -> None:
    path = require_minilm()
    st = pytest.importorskip("sentence_transformers")
    reference = torch.from_numpy(st.SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    ours = _embed(path, TEXTS)
    assert ours.shape == reference.shape == (len(TEXTS), 384)
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min().item() >= 0.9999
    assert (ours - reference).abs().max().item() < 1e-5
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_padding_does_not_change_a_vector() -> None:
    """One text alone and the same text padded beside a longer one pool to the same vector."""
    path = require_minilm()
    alone = _embed(path, TEXTS[2:3])
    batched = _embed(path, TEXTS[:3])
    assert (alone[0] - batched[2]).abs().max().item() < 1e-5


def test_matryoshka_truncates_then_renormalises(tmp_path: Path) -> None:
    path = matryoshka_copy(require_minilm(), tmp_path)
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(path), device="cpu", truncate_dim=128)
    reference = torch.from_numpy(model.encode(TEXTS, normalize_embeddings=True))
    ours = _embed(path, TEXTS, dimensions=128)
    assert ours.shape == (len(TEXTS), 128)
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min().item() >= 0.9999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def _tiny_bert(tmp_path: Path, **overrides: object) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        **overrides,
    )
    out = tmp_path / "bert"
    BertModel(config).save_pretrained(out)
    return out


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_random_bert_equals_transformers_hidden_states(tmp_path: Path, act: str) -> None:
    from transformers import BertModel

    path = _tiny_bert(tmp_path, hidden_act=act)
    reference_model = BertModel.from_pretrained(path).eval()
    config = json.loads((path / "config.json").read_text())
    ours = load_bert(path, config, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 120, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, 3:] = False
    with torch.inference_mode():
        expected = reference_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = ours(ids, mask)
    assert (got - expected)[mask].abs().max().item() < 1e-5
    # a mean over the real tokens only: the reference pooled by hand
    weights = mask[..., None].float()
    mean = (expected * weights).sum(1) / weights.sum(1)
    assert (pool(got, mask, "mean") - mean).abs().max().item() < 1e-5
    assert (pool(got, mask, "cls") - expected[:, 0]).abs().max().item() < 1e-5
    last = expected[torch.arange(3), mask.sum(1) - 1]
    assert (pool(got, mask, "last") - last).abs().max().item() < 1e-5


def test_a_packed_batch_equals_transformers_and_multiplies_only_real_tokens(
    tmp_path: Path,
) -> None:
    """`hidden_states` runs the inputs one after another without padding: each input's states
    equal transformers' on the padded batch, and the layers' products see the real tokens
    only (padded, this batch would put 4 x 13 rows through each)."""
    from transformers import BertModel

    path = _tiny_bert(tmp_path)
    reference_model = BertModel.from_pretrained(path).eval()
    config = json.loads((path / "config.json").read_text())
    ours = load_bert(path, config, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 13, 1, 8]
    rows = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in lengths]
    seen: list[int] = []
    ours.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[0])
    )
    hidden, mask = ours.hidden_states(rows)
    assert seen == [sum(lengths)]
    assert mask.sum(1).tolist() == lengths and hidden.shape == (4, 13, 64)
    ids = torch.zeros(4, 13, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    with torch.inference_mode():
        expected = reference_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert (hidden - expected)[mask].abs().max().item() < 1e-5
    assert hidden[~mask].abs().max().item() == 0.0


def test_a_checkpoint_short_of_a_tensor_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _tiny_bert(tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"encoder\.layer\.1\.output\.dense\.weight"):
        load_bert(path, config, torch.float32, torch.device("cpu"))


def test_the_generating_engine_refuses_an_encoder(tmp_path: Path) -> None:
    """Without the refusal transformers' fallback built a BertModel a causal LM with an
    untrained head, and `stallfree generate` printed noise."""
    from stallfree.runtime.engine import Engine
    from tests.engine_util import engine_config

    for path in (require_minilm(), _tiny_bert(tmp_path)):
        with pytest.raises(ModelLoadError, match="BertModel is an encoder: it cannot generate"):
            Engine(engine_config(str(path)))
