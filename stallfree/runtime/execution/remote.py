"""The host side of worker processes: the step message and `RemoteExecutor`, which sends each
planned step to the rank-0 worker (`execution/worker.py`) and copies its result back into the
step's host buffers."""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.overlap.process_stream import ProcessStream, decode_tensor, encode_tensor
from stallfree.overlap.stream import Event
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.planner import StepArgs
from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.text.grammar_compiler import RequestGrammar

# ---------------------------------------------------------------------- the step message


@dataclass(slots=True)
class StepMessage:
    """One launched step for the workers: its `StepArgs` without what stays on the host (the
    shared request table and KV cache, the host buffers the results land in), and the
    `req_to_token` writes made on the host replica since the previous step."""

    args: StepArgs
    table_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    # imported KV ("kv", layer, slot slices, k per rank, v per rank), first tokens
    # ("stash", slots, tokens), speculative histories ("history", rows, cols, tokens) and
    # LoRA slot fills ("lora", slot, the whole adapter's weights), applied in order after the
    # table writes
    imports: list[tuple[Any, ...]] = field(default_factory=list)


# stands in for the tensors a message leaves out (each rank has its own)
_LEFT_OUT = torch.empty(0, dtype=torch.int64)


def _no_kv_cache() -> None:
    """What a step message's KV cache unpickles to: the host's has no buffers, and each rank
    sets its own before running the step."""
    return None


@dataclass(slots=True)
class StepResult:
    token_ids: Any  # encoded [B] int64
    logprobs: dict[str, Any] | None  # LogprobBuffers fields, encoded
    step_seconds: float
    # the grammar part's stream -> host facts (`GrammarPlan.ended`, `.tokens`, `.seconds`)
    grammar: tuple[dict[int, tuple[str, str, int]], int, float] | None = None
    # a verify step's rows' lengths as it left them (encoded [B] int64; speculation only)
    lengths: Any = None


class _TensorPickler(pickle.Pickler):
    """Pickles CPU tensors as raw bytes (`encode_tensor`): no storage sharing, no numpy; a
    request's grammar as its text (each worker builds its own matcher: `StepUnpickler`)."""

    def persistent_id(self, obj: object) -> Any:
        if isinstance(obj, RequestGrammar):
            return ("grammar", obj.text)
        return None

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, torch.Tensor):
            return decode_tensor, (encode_tensor(obj),)
        if isinstance(obj, KVCache):
            return _no_kv_cache, ()  # each rank puts its own cache in its place
        return NotImplemented


def dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class StepUnpickler(pickle.Unpickler):
    """A worker's reader of step messages: a grammar's text becomes a matcher of its own."""

    def __init__(self, data: bytes, matchers: Callable[[str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.matchers = matchers

    def persistent_load(self, pid: Any) -> Any:
        kind, text = pid
        if kind != "grammar":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        return RequestGrammar(text, self.matchers(text))


class RemoteExecutor:
    """The host's executor when the model lives in worker processes: the step, planned on the
    host as for any executor, goes to the rank-0 worker in a step message."""

    def __init__(self, ctx: BatchContext, stream: ProcessStream) -> None:
        self.ctx = ctx
        self.remote = stream

    def dispatch(self, args: StepArgs) -> Event:
        logprobs, token_ids_cpu = args.logprobs, args.token_ids_cpu
        journal = self.ctx.table_journal
        assert journal is not None
        writes, journal[:] = list(journal), []
        imports = self.ctx.import_journal
        assert imports is not None
        imported, imports[:] = list(imports), []
        fb = dataclasses.replace(args.fb, req_to_token=_LEFT_OUT)
        sent = dataclasses.replace(args, fb=fb, token_ids_cpu=_LEFT_OUT, logprobs=None)
        message = StepMessage(sent, writes, imported)
        stream = self.remote

        grammar = args.plan.grammar if args.plan is not None else None
        seq_lens = args.fb.seq_lens  # the host replica's tensor, not the message's copy

        def take(result: StepResult) -> None:
            token_ids_cpu.copy_(decode_tensor(result.token_ids))
            if result.lengths is not None:
                with stream.packing():  # the replica of device state follows the workers'
                    seq_lens.copy_(decode_tensor(result.lengths))
            if grammar is not None and result.grammar is not None:
                ended, tokens, seconds = result.grammar
                grammar.ended.update(ended)
                grammar.tokens += tokens
                grammar.seconds += seconds
            if logprobs is not None and result.logprobs is not None:
                for name, enc in result.logprobs.items():
                    getattr(logprobs, name).copy_(decode_tensor(enc))
            stream.add_busy(result.step_seconds)

        with stream.packing():
            payload = dumps(message)
        stream.send_payload(payload, take)
        return stream.record_event()
