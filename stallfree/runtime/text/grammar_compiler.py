"""Compiling structured-output specs into llguidance matchers, off the schedule path.

`GrammarCompiler.matcher(spec)` is awaited by `Engine` before the request is queued: the spec
becomes an llguidance grammar, which is validated and compiled in a worker thread (llguidance
drops the GIL while it compiles), so neither the event loop nor the scheduler waits for it. A
compiled matcher is kept per grammar text (`text/grammar_cache.py`: LRU, capped by estimated
bytes) and each request gets a `deep_copy` of it, so a schema that every request repeats
compiles once.

A grammar the backend refuses is an `InvalidRequestError` naming the client's field. The
matcher the request gets is the stream's from then on (`execution/grammar_masks.py` advances it).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.request.structured import StructuredOutputs
from stallfree.runtime.text.ascii_regex import ascii_classes
from stallfree.runtime.text.grammar_cache import DEFAULT_MAX_BYTES, GrammarCache
from stallfree.runtime.text.integer_bounds import IntegerBoundError
from stallfree.runtime.text.strict_schema import prepare_lark, prepare_schema
from stallfree.runtime.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

# JSON without free whitespace between tokens (the schema's own "x-guidance" may ask for it):
# a model cannot pad its answer with whitespace until max_tokens
_JSON_DEFAULTS: Any = {"whitespace_flexible": False}


class _ByteVocab:
    """`ByteTokenizer` as llguidance's `TokenizerWrapper` wants it: each id's bytes."""

    def __init__(self, tok: ByteTokenizer, vocab_size: int) -> None:
        self.eos_token_id = tok.EOS
        self.bos_token_id = tok.BOS
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def build_lltokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """The llguidance tokenizer for `tokenizer`, its masks `vocab_size` (the logits') wide."""
    import llguidance

    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, HFTokenizer):
        raw = copy.copy(tokenizer.raw)
        raw.no_padding()
        raw.no_truncation()
        return llguidance.LLTokenizer(raw.to_str(), n_vocab=vocab_size, eos_token=eos)
    raise TypeError(f"structured outputs do not support a {type(tokenizer).__name__}")


def grammar_text(spec: StructuredOutputs, strict: bool = True) -> str:
    """The llguidance grammar for `spec` (not yet checked). A JSON schema, and each `%json`
    schema of a Lark grammar, is read as vLLM's default backend reads it (strict unless
    `strict` is off, regex classes in ASCII), and a regex's classes are ASCII
    (`text/strict_schema.py`)."""
    from llguidance import LLMatcher, grammar_from

    kind = spec.kind
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', _JSON_DEFAULTS)
    if kind == "json":
        schema = json.loads(spec.schema_text)
        text = spec.schema_text
        if isinstance(schema, dict):
            text = json.dumps(prepare_schema(schema, strict), ensure_ascii=False)
        return LLMatcher.grammar_from_json_schema(text, _JSON_DEFAULTS)
    if kind == "regex":
        assert spec.regex is not None
        return LLMatcher.grammar_from_regex(ascii_classes(spec.regex))
    if kind == "choice":
        assert spec.choice is not None
        return grammar_from("choice", spec.choice)  # type: ignore[arg-type]
    assert spec.grammar is not None
    return grammar_from("grammar", prepare_lark(spec.grammar, strict))


def unsupported_reason(device: str, in_process: bool) -> str | None:
    """Why an engine laid out like this cannot constrain its output, or None.

    A matcher lives where its request's tokens are sampled: on the CPU stream's thread in this
    process, or in each worker process (which runs a step whole before the next). The CUDA
    stream in this process launches a step before the previous one's tokens are on the host,
    so its masks are not computed yet (docs/structured.md)."""
    if in_process and device != "cpu":
        return (
            f"structured outputs are not available on the in-process {device} stream yet; "
            "start the server with --worker process"
        )
    return None


class DeadEndGrammar(InvalidRequestError):
    """A grammar no output satisfies, found at compile time; `reason` without the field."""

    def __init__(self, reason: str, param: str) -> None:
        super().__init__(f"{param}: {reason}", param=param, code="grammar_dead_end")
        self.reason = reason


@dataclass(slots=True, eq=False)
class RequestGrammar:
    """A request's grammar: the checked llguidance grammar text, and the request's own matcher.

    The matcher lives where the request's tokens are sampled. In this process that is this one;
    a step message to worker processes carries the text alone (`execution/remote.py`), and each
    worker rebuilds the matcher from it with its own `MatcherFactory`."""

    text: str
    matcher: Any


class MatcherFactory:
    """Matchers from checked grammar texts, for a process that samples (a worker): compiled
    once per text (LRU, capped by estimated bytes), each call a fresh copy. The tokenizer is
    built on first use."""

    def __init__(
        self,
        tokenizer: Callable[[], Tokenizer],
        vocab_size: int,
        cache_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok: Any = None
        self.cache: GrammarCache[Any] = GrammarCache(cache_bytes)

    def __call__(self, text: str) -> Any:
        from llguidance import LLMatcher

        template = self.cache.get(text)
        if template is None:
            if self._lltok is None:
                self._lltok = build_lltokenizer(self._tokenizer(), self.vocab_size)
            template = LLMatcher(self._lltok, text, log_level=0)
            if template.is_error():  # the host checked this text with the same vocabulary
                raise RuntimeError(f"grammar: {_one_line(template.get_error())}")
            self.cache.put(text, template, text)
        return template.deep_copy()


class GrammarCompiler:
    """Compiles specs in worker threads and hands each request its own matcher."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        unsupported: str | None = None,
        workers: int = 2,
        strict: bool = True,
        cache_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.strict = strict  # JSON schemas allow only what they name (text/strict_schema.py)
        self.vocab_size = vocab_size
        # why this engine cannot constrain output (its layout), or None
        self.unsupported = unsupported
        self._pool: ThreadPoolExecutor | None = None
        self._workers = workers
        self._lltok: Any = None
        self._lock = threading.Lock()
        # compiled grammars by spec: (grammar text, template matcher); a request copies one
        self.cache: GrammarCache[tuple[str, Any]] = GrammarCache(cache_bytes)
        self._pending: dict[str, asyncio.Future[tuple[str, Any]]] = {}
        # specs found to dead-end, by key (oldest first), with the reason: refused at once
        self._dead_ends: dict[str, str] = {}
        # figures for the benchmark and the logs: compilations, cache hits, seconds compiling
        self.compiled = 0
        self.hits = 0
        self.compile_seconds = 0.0

    def lltokenizer(self) -> Any:
        """Built once, on first use (about a second for a large vocabulary)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = build_lltokenizer(self.tokenizer, self.vocab_size)
            return self._lltok

    async def matcher(
        self, spec: StructuredOutputs, param: str = "structured_outputs"
    ) -> RequestGrammar:
        """`spec`'s grammar with a fresh matcher, compiled in a worker (or copied from the
        cache)."""
        if self.unsupported is not None:
            raise InvalidRequestError(self.unsupported, param=param, code="unsupported")
        key = f"{spec.kind}\0{self._key(spec)}"
        if (refused := self._dead_ends.get(key)) is not None:
            self.hits += 1  # a client looping on a dead end compiles it once
            raise DeadEndGrammar(refused, param)
        compiled = self.cache.get(key)
        if compiled is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._workers, thread_name_prefix="stallfree-grammar"
                )
            pending = self._pending.get(key)
            if pending is None:
                # a burst of one schema compiles it once: the others wait for the same future
                loop = asyncio.get_running_loop()
                pending = loop.run_in_executor(self._pool, self._compile, spec, param)
                self._pending[key] = pending
                pending.add_done_callback(lambda _: self._pending.pop(key, None))
            else:
                self.hits += 1
            try:
                compiled = await asyncio.shield(pending)
            except DeadEndGrammar as exc:
                self._dead_ends[key] = exc.reason
                while len(self._dead_ends) > DEAD_ENDS_KEPT:
                    self._dead_ends.pop(next(iter(self._dead_ends)))
                raise DeadEndGrammar(exc.reason, param) from None
            self.cache.put(key, compiled, compiled[0])
        else:
            self.hits += 1
        text, template = compiled
        return RequestGrammar(text, template.deep_copy())

    @staticmethod
    def _key(spec: StructuredOutputs) -> str:
        kind = spec.kind
        if kind == "json":
            return spec.schema_text
        if kind == "choice":
            return "\0".join(spec.choice or ())
        return (spec.regex if kind == "regex" else spec.grammar) or ""

    def _compile(self, spec: StructuredOutputs, param: str) -> tuple[str, Any]:
        """Worker thread: the grammar, checked and compiled."""
        from llguidance import LLMatcher

        start = time.perf_counter()
        tok = self.lltokenizer()
        try:
            grammar = grammar_text(spec, self.strict)
        except RecursionError as e:  # reading or preparing a schema nested thousands deep
            raise InvalidRequestError(
                f"{param}: the {_what(spec)} nests too deeply", param=param
            ) from e
        except IntegerBoundError as e:
            raise InvalidRequestError(f"{param}: {e}", param=param) from e
        except ValueError as e:
            what = "the JSON schema is not valid JSON: " if spec.kind == "json" else ""
            raise InvalidRequestError(f"{param}: {what}{_one_line(str(e))}", param=param) from e
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if failed:
            raise InvalidRequestError(
                f"{param}: the {_what(spec)} cannot be compiled: {_one_line(messages[0])}",
                param=param,
            )
        matcher = LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: {_one_line(matcher.get_error())}", param=param)
        if (dead_end := first_mask_error(matcher, self.vocab_size)) is not None:
            reason = f"the {_what(spec)} reaches a dead end in its first tokens: {dead_end}"
            raise DeadEndGrammar(_one_line(reason), param)
        self.compiled += 1
        self.compile_seconds += time.perf_counter() - start
        return grammar, matcher

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# forced tokens followed from the start when looking for a dead end at compile time
FORCED_STEPS = 16
# dead-end specs remembered (their keys: at most 64 KiB each)
DEAD_ENDS_KEPT = 64


def first_mask_error(matcher: Any, vocab_size: int) -> str | None:
    """Why `matcher` reaches a dead end before its output can branch, or None.

    The first masks are computed here, in the compile worker, on a copy: while exactly one
    token is allowed it is taken (at most `FORCED_STEPS`), and an error on the way is the
    grammar's dead end (a node that must hold a node: after its forced `{` llguidance walks to
    its item limit). That way such a grammar is refused before it costs the shared stream a
    step per request, and the lexer states the first masks build are the compiled grammar's
    (its copies share them)."""
    import llguidance.numpy as llnp
    import numpy as np

    probe = matcher.deep_copy()
    mask = llnp.allocate_token_bitmask(1, vocab_size)
    for _ in range(FORCED_STEPS):
        llnp.fill_next_token_bitmask(probe, mask, 0)
        if probe.is_error():
            return str(probe.get_error())
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if len(allowed) != 1 or probe.is_accepting():
            return None
        if not probe.consume_token(int(allowed[0])):
            return str(probe.get_error())
    return None


def _what(spec: StructuredOutputs) -> str:
    return "JSON schema" if spec.kind == "json" else spec.kind


def _one_line(message: str, limit: int = 300) -> str:
    line = " ".join(message.split()) or "invalid grammar"
    return line if len(line) <= limit else line[: limit - 3] + "..."
