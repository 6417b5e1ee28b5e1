"""Targets: where requests go. What every target offers (`Target`), the client-side timing they
share (`RequestTimer`), and the embedded `Engine` (`InProcessTarget`); the servers over HTTP
are in `http_targets`. Every target times each request from the client's side."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from stallfree.bench.counters import CounterSnapshot, snapshot_engine
from stallfree.bench.results import RequestRecord
from stallfree.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from stallfree.config import StallfreeConfig
    from stallfree.runtime.engine import Engine


# finish reasons that mean the request failed
FAILED_FINISHES = ("error", "abort")


class TargetError(RuntimeError):
    """The target cannot be used (unreachable, no model, failed to start)."""


@dataclass(slots=True)
class RequestOptions:
    temperature: float = 0.0
    ignore_eos: bool = False
    max_tokens: int | None = None  # caps each request's own output_len (warm-up)


class Target(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(self, req: BenchRequest, opts: RequestOptions) -> RequestRecord: ...

    async def counters(self) -> CounterSnapshot | None: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class RequestTimer:
    """Client-side token timing: TTFT at the first content, one ITL per later content chunk."""

    record: RequestRecord
    t0: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def content(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft = now - self.t0
        else:
            self.record.itls.append(now - self.last)
        self.last = now

    def done(self) -> RequestRecord:
        self.record.e2e = time.perf_counter() - self.t0
        return self.record


class InProcessTarget:
    """A fresh embedded `Engine` with the given configuration."""

    def __init__(self, config: StallfreeConfig) -> None:
        self.config = config
        self.engine: Engine | None = None

    async def start(self) -> None:
        from stallfree.runtime.engine import Engine

        self.engine = Engine(self.config)
        await self.engine.start()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None

    async def send(self, req: BenchRequest, opts: RequestOptions) -> RequestRecord:
        from stallfree.runtime.request.sampling_params import SamplingParams

        assert self.engine is not None
        record = RequestRecord(req.prompt_len, req.output_len, input_tokens=req.prompt_len)
        timer = RequestTimer(record)
        params = SamplingParams(
            max_new_tokens=min(req.output_len, opts.max_tokens or req.output_len),
            temperature=opts.temperature,
            ignore_eos=opts.ignore_eos,
        )
        try:
            async for chunk in self.engine.generate(req.prompt, params):
                if chunk.token_ids:
                    timer.content()
                record.generated_text += chunk.text
                if chunk.finished:
                    record.finish_reason = chunk.finish_reason
                    record.input_tokens = chunk.prompt_tokens
                    record.output_tokens = chunk.completion_tokens
                    record.error = chunk.error
        except Exception as exc:  # the engine's refusals are failed requests, not crashes
            record.error = f"{type(exc).__name__}: {exc}"
            return timer.done()
        record.success = record.error is None and record.finish_reason not in FAILED_FINISHES
        return timer.done()

    async def counters(self) -> CounterSnapshot | None:
        assert self.engine is not None
        return snapshot_engine(self.engine)

    def describe(self) -> dict[str, Any]:
        return {"kind": "inprocess", "engine_config": self.config.model_dump(mode="json")}
