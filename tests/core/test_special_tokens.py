"""`skip_special_tokens` and `spaces_between_special_tokens` in decoding: whole decodes and
streamed deltas (one id at a time and in chunks) equal transformers'
`AutoTokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)` for a
tokenizer.json; a decoder that puts spaces between tokens loses the one between two added tokens
with `spaces_between_special_tokens` off (vLLM's fast detokenizer); the byte tokenizer writes
`<s>` and `</s>` by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from stallfree.runtime.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tests.hf_models import write_tokenizer

# bytes of "héllo wörld" around <s> (256) and </s> (257), adjacent specials, a split character
IDS = [104, 195, 169, 256, 257, 108, 32, 256, 119, 195, 256, 182, 257, 257, 100]
OPTIONS = [(True, True), (False, True), (False, False), (True, False)]


def _streamed(tok: Tokenizer, ids: list[int], skip: bool, spaces: bool, chunks: int) -> str:
    detok = tok.detokenizer([104, 105], skip, spaces)
    rng = random.Random(chunks)
    out, i = [], 0
    while i < len(ids):
        n = 1 if chunks == 1 else rng.randint(1, chunks)
        out.append(detok.step(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    return "".join(out)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return out


@pytest.mark.parametrize(("skip", "spaces"), OPTIONS)
def test_hf_decodes_and_streams_as_transformers(hf_dir: Path, skip: bool, spaces: bool) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = IDS + [ord(c) for c in " tail"] + [256]
    rng = random.Random(0)
    cases = [ids] + [[rng.choice([*range(256), 256, 257]) for _ in range(40)] for _ in range(20)]
    tok = HFTokenizer(hf_dir)
    for seq in cases:
        expected = ref.decode(seq, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert tok.decode(seq, skip, spaces) == expected
        for chunks in (1, 3, 7):
            assert _streamed(tok, seq, skip, spaces, chunks) == expected, (seq, chunks)
    if not skip:
        assert "<s></s>" in tok.decode(IDS, skip, spaces)


def test_spaces_between_added_tokens_follow_vllm(tmp_path: Path) -> None:
    """A WordPiece decoder joins tokens with spaces: off, two added tokens in a row are joined
    without one (vLLM's rule), streamed or not."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models

    raw = Raw(models.WordLevel(vocab={"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(["[X]", "[Y]"])
    tok = HFTokenizer.from_raw(raw)
    x, y = raw.token_to_id("[X]"), raw.token_to_id("[Y]")
    ids = [0, x, y, 1, y]
    assert tok.decode(ids, False, True) == "a [X] [Y] b [Y]"
    assert tok.decode(ids, False, False) == "a [X][Y] b [Y]"
    assert tok.decode(ids) == "a b"
    for skip, spaces in OPTIONS:
        for chunks in (1, 2):
            assert _streamed(tok, ids, skip, spaces, chunks) == tok.decode(ids, skip, spaces)


@pytest.mark.parametrize(("skip", "spaces"), OPTIONS)
def test_byte_tokenizer_keeps_specials_by_name(skip: bool, spaces: bool) -> None:
    tok = ByteTokenizer()
    text = tok.decode(IDS, skip, spaces)
    if skip:
        assert text == bytes(i for i in IDS if i < 256).decode("utf-8", "replace")
    else:
        # the split character before <s> cannot finish: it is U+FFFD, as a decode of each run
        assert text == "hé<s></s>l <s>w\ufffd<s>\ufffd</s></s>d"
    for chunks in (1, 3, 7):
        assert _streamed(tok, IDS, skip, spaces, chunks) == text
    assert tok.decode([258, 97], skip_special_tokens=False) == "a"  # padding reads as nothing
