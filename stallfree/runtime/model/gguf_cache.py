"""What loading derives from a GGUF file, kept on disk so that a second start skips the parse.

`gguf.GGUFReader` parses every metadata field into numpy slices, one per vocabulary entry and
merge: seconds for a 49k vocabulary, more than the rest of a small model's load. The first load
of a file parses it once and writes an index: the metadata fields (scalars and small arrays
whole; a large array only its length), the tokenizer as `tokenizers` JSON, and the tensor table
(name, ggml type, dimensions, byte offset, byte count). A later load reads the index and maps
the file: no reader is built, and each tensor's bytes are the same slice of the same file.

- Directory: `STALLFREE_CACHE_DIR`, default `~/.cache/stallfree/gguf/`; one JSON file per GGUF.
- Key: sha256 of the file's size, mtime (ns) and first and last MiB; a rewritten file misses.
- Written atomically (a temp file, then `os.replace`): processes that start together (workers,
  tensor-parallel ranks) each write a whole file and the last one stays.
- An entry that does not parse, or was written by another format or another version of the
  code that derives it (gguf.py, this file), is rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "STALLFREE_CACHE_DIR"
FORMAT_VERSION = 1
# an array field of more elements is the tokenizer's (tokens, merges, types, scores): the
# index keeps only its length, and the tokenizer built from it
SMALL_ARRAY = 1024
_EDGE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGUF's order: innermost first
    offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True, slots=True)
class TokenizerEntry:
    json: str  # tokenizers.Tokenizer.to_str()
    bos_token: str
    eos_token: str
    chat_template: str | None


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    fields: dict[str, Any]  # scalars and arrays of at most SMALL_ARRAY elements
    array_lengths: dict[str, int]  # every array field
    tensors: list[TensorEntry]
    byte_order: str  # GGUFReader's: "I" native, "S" swapped
    tokenizer: TokenizerEntry | None  # None: the file's could not be built


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor as `GGUFReader` gives it: `data` a read-only view of the mapped file (raw
    block bytes [..., bytes per row] for a quantized type)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first
    data: np.ndarray


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "stallfree" / "gguf"


def file_key(path: Path) -> str:
    """The file's identity: its size, mtime and first and last MiB (a whole-file hash would cost
    seconds on a multi-GB file)."""
    stat = path.stat()
    h = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with path.open("rb") as f:
        h.update(f.read(_EDGE_BYTES))
        f.seek(max(0, stat.st_size - _EDGE_BYTES))
        h.update(f.read(_EDGE_BYTES))
    return h.hexdigest()


@functools.cache
def code_version() -> str:
    """A digest of the code whose output the index holds (and of the `tokenizers` version that
    wrote its JSON): an edit to it invalidates every entry, so a fixed tokenizer is never
    served stale from the cache."""
    import tokenizers

    h = hashlib.sha256(f"{FORMAT_VERSION}:{tokenizers.__version__}".encode())
    here = Path(__file__).parent
    for name in ("gguf.py", "gguf_cache.py"):
        try:
            h.update((here / name).read_bytes())
        except OSError:
            h.update(name.encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- read, write


def load_index(key: str) -> GGUFIndex | None:
    """The cached index of the file with this key; None if absent, unreadable or stale."""
    path = cache_dir() / f"{key}.json"
    try:
        record = json.loads(path.read_bytes())
        if record.get("format") != FORMAT_VERSION or record.get("code") != code_version():
            return None
        return _index_from_record(record["index"])
    except FileNotFoundError:
        return None
    except Exception as e:  # a torn or foreign file: rebuilt and replaced
        logger.warning("GGUF cache entry %s is unreadable (%s); rebuilding it", path, e)
        return None


def store_index(key: str, index: GGUFIndex) -> Path | None:
    """Writes the entry atomically; a cache that cannot be written only costs the next start."""
    directory = cache_dir()
    record = {"format": FORMAT_VERSION, "code": code_version(), "index": asdict(index)}
    tmp: str | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, ensure_ascii=False)
        target = directory / f"{key}.json"
        os.replace(tmp, target)
        logger.info("GGUF file parsed once; its index is cached in %s", target)
        return target
    except OSError as e:
        logger.warning(
            "cannot write the GGUF cache in %s (%s); the next start parses again", directory, e
        )
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None


def _index_from_record(raw: dict[str, Any]) -> GGUFIndex:
    tok = raw["tokenizer"]
    return GGUFIndex(
        fields=dict(raw["fields"]),
        array_lengths={str(k): int(v) for k, v in raw["array_lengths"].items()},
        tensors=[
            TensorEntry(
                str(t["name"]),
                int(t["ggml_type"]),
                tuple(int(d) for d in t["dims"]),
                int(t["offset"]),
                int(t["n_bytes"]),
            )
            for t in raw["tensors"]
        ],
        byte_order=str(raw["byte_order"]),
        tokenizer=TokenizerEntry(**tok) if tok is not None else None,
    )


# ---------------------------------------------------------------------------- from the reader


def index_from_reader(
    reader: Any, fields: dict[str, Any], tokenizer: TokenizerEntry | None
) -> GGUFIndex:
    """The index of a parsed file; `fields`: every field's contents (the reader's)."""
    lengths = {
        name: len(field.data)
        for name, field in reader.fields.items()
        if field.types and field.types[0].name == "ARRAY"
    }
    small = {k: v for k, v in fields.items() if lengths.get(k, 0) <= SMALL_ARRAY}
    tensors = [
        TensorEntry(
            t.name,
            int(t.tensor_type),
            tuple(int(d) for d in t.shape),
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in reader.tensors
    ]
    return GGUFIndex(small, lengths, tensors, str(reader.byte_order), tokenizer)


def reader_fields(reader: Any) -> dict[str, Any]:
    """Every field's contents; one whose strings are not UTF-8 is left out (as if absent)."""
    fields = {}
    for name, field in reader.fields.items():
        try:
            fields[name] = field.contents()
        except UnicodeDecodeError:
            logger.warning("GGUF field %r is not UTF-8; it is ignored", name)
    return fields


# ---------------------------------------------------------------------------- tensors


_PLAIN_TYPES: dict[str, np.dtype[Any]] = {
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}


def drop_pages(tensor: GGUFTensor) -> None:
    """Take a mapped tensor's file pages out of this process's resident set once it has been
    copied out (`madvise(MADV_DONTNEED)` on a read-only file mapping: the pages stay in the
    page cache and read back unchanged if touched again). Without it a load holds the whole
    file's pages beside the weights made from them until the mapping closes: a 2.15 GB BF16
    file and its 2.15 GB copy at once. A tensor that is not such a view is left alone."""
    root: Any = tensor.data
    while isinstance(getattr(root, "base", None), np.ndarray):
        root = root.base  # views of views, down to the array over the whole mapping
    handle = getattr(root, "base", None)
    if not isinstance(handle, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base = root.__array_interface__["data"][0]  # the mapping's first byte (map_tensors: offset 0)
    start = tensor.data.__array_interface__["data"][0] - base
    first = start - start % mmap.PAGESIZE
    end = start + tensor.data.nbytes
    # whole pages inside the tensor only: a page shared with the next tensor stays
    end -= end % mmap.PAGESIZE
    if end > first:
        handle.madvise(mmap.MADV_DONTNEED, first, end - first)


def map_tensors(path: Path, index: GGUFIndex) -> list[GGUFTensor]:
    """The tensors as views of the memory-mapped file, shaped and typed as GGUFReader's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    out = []
    for t in index.tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        np_dims: tuple[int, ...] = tuple(reversed(t.dims))
        item = _PLAIN_TYPES.get(qtype.name)
        if item is None:
            item = np.dtype(np.uint8)
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        view = data[t.offset : t.offset + t.n_bytes].view(item)
        order: Any = index.byte_order
        view = view.view(view.dtype.newbyteorder(order)).reshape(np_dims)
        out.append(GGUFTensor(t.name, qtype, t.dims, view))
    return out
