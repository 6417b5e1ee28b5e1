"""One prepared script for a lent GPU: run it once, paste its output into the closing note.

    python benchmarks/gpu_check.py

1. Streams and events overlap: the host returns from a launch long before the device finishes.
2. `torch.cuda.set_sync_debug_mode("error")` stays silent through batch preparation in overlap
   mode with mirrors on (strict mode), over a real decode workload.
3. Worker processes on CUDA: the process worker (tp_size 1) gives the in-process engine's greedy
   tokens; with two or more GPUs, tensor parallelism over NCCL (tp_size 2) gives them too, and
   the per-rank step and collective figures are printed.
4. wall / device-busy for the four modes on a small model in bf16 (benchmarks/bench_overlap.py).
5. Prefill/decode disaggregation on CUDA: two engines in this process joined by the loopback
   transport (the KV read from and written to the device on each engine's stream) give the
   colocated engine's greedy tokens; with two or more GPUs, the NCCL transport between two
   processes (one GPU each) moves KV-sized tensors, checked equal, with GB/s.
6. Structured outputs on CUDA: JSON-schema requests (seeded, sampled, and greedy) with the
   model in a worker process, overlap and mirrors on, strict: every reply parses and conforms,
   no schedule-path read; tokens/s with and without the schema; the in-process CUDA stream
   answers such a request with a clear "unsupported" error.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def check_stream_overlap() -> None:
    from stallfree.overlap.stream import CudaStream

    stream = CudaStream(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    stream.submit(torch.matmul, a, a)  # the first product loads cuBLAS: keep it out of the timing
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        stream.submit(torch.matmul, a, a)
    event = stream.record_event()
    launched = time.perf_counter() - start
    pending = not event.query()
    event.synchronize()
    total = time.perf_counter() - start
    print(
        f"[1] launch {launched * 1e3:.2f} ms, device done after {total * 1e3:.2f} ms, "
        f"event pending right after launch: {pending}"
    )
    assert pending and launched < total / 5, "launches did not return before the device finished"


async def check_sync_debug_mode() -> None:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(
        model={"path": "bench-cpu", "dtype": "bfloat16"},
        runtime={"device": "cuda", "overlap": True, "cpu_mirrors": True, "strict": True},
    )
    async with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        prompts = [[(i * 7 + j) % 256 for j in range(32)] for i in range(16)]
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        errors = [r.error for r in results if r.error]
        steps = engine.snapshot().counters.steps
        print(
            f"[2] strict overlap+mirrors on CUDA: {steps} steps, "
            f"schedule-path reads {engine.core.monitor.schedule_path_reads}, errors {errors[:1]}"
        )
        assert not errors and engine.core.monitor.schedule_path_reads == 0


async def _greedy(**sections: object) -> tuple[list[list[int]], float, object]:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(model={"path": "bench-cpu", "dtype": "bfloat16"}, **sections)
    async with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=64, ignore_eos=True)
        prompts = [[(i * 11 + j) % 256 for j in range(48)] for i in range(32)]
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        wall = time.perf_counter() - start
        return [r.token_ids for r in results], wall, engine.snapshot().workers


async def check_workers() -> None:
    want, wall_in, _ = await _greedy(runtime={"device": "cuda", "worker": "inprocess"})
    got, wall_proc, workers = await _greedy(runtime={"device": "cuda", "worker": "process"})
    same = sum(a == b for a, b in zip(want, got, strict=True))
    print(
        f"[3] process worker, tp 1: {same}/{len(want)} greedy outputs equal in-process; "
        f"wall {wall_in:.2f}s in-process, {wall_proc:.2f}s process; {workers}"
    )
    if torch.cuda.device_count() < 2:
        print("[3] one GPU: tensor parallelism over NCCL not checked")
        return
    got2, wall_tp, workers = await _greedy(runtime={"device": "cuda"}, parallel={"tp_size": 2})
    same2 = sum(a == b for a, b in zip(want, got2, strict=True))
    print(f"[3] tp 2 over NCCL: {same2}/{len(want)} equal tp 1; wall {wall_tp:.2f}s")
    for w in workers:
        share = w.comm_seconds / w.step_seconds if w.step_seconds else 0.0
        print(
            f"    rank {w.rank}: {w.steps} steps, {1e3 * w.step_seconds / max(w.steps, 1):.2f} "
            f"ms/step, collectives {share:.0%} of step time (host-side launch time on NCCL), "
            f"{w.comm_bytes / max(w.steps, 1) / 1024:.1f} KiB/step"
        )


async def check_disagg_loopback() -> None:
    from stallfree import Engine, SamplingParams, load_config
    from stallfree.disagg.bootstrap import LocalControl
    from stallfree.disagg.decode import DecodeSide
    from stallfree.disagg.prefill import PrefillSide

    def cfg(mode: str | None) -> object:
        sections: dict[str, dict[str, object]] = {
            "model": {"path": "bench-cpu", "dtype": "bfloat16"},
            "runtime": {"device": "cuda"},
            "cache": {"page_size": 16, "max_total_tokens": 65536},
        }
        if mode:
            sections["disaggregation"] = {"mode": mode, "transfer_backend": "loopback"}
        return load_config(**sections)

    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    prompts = [[(i * 13 + j) % 256 for j in range(200 + 37 * i)] for i in range(8)]
    async with Engine(cfg(None)) as colocated:
        want = [
            r.token_ids
            for r in await asyncio.gather(*(colocated.complete(p, params) for p in prompts))
        ]
    pc, dc = cfg("prefill"), cfg("decode")
    async with Engine(pc) as prefill, Engine(dc) as decode:
        p = PrefillSide(prefill, pc.disaggregation, backend="loopback")  # type: ignore[attr-defined]
        control = LocalControl(p)
        d = DecodeSide(decode, dc.disaggregation, controls=lambda h, port: control)  # type: ignore[attr-defined]
        await p.start()
        await d.start()

        async def one(i: int, ids: list[int]) -> list[int]:
            out: list[int] = []

            async def decode_leg() -> None:
                async for chunk in d.generate(ids, params, f"d{i}", i, "127.0.0.1", 0):
                    out.extend(chunk.token_ids)

            await asyncio.gather(p.prefill(ids, params, f"p{i}", i), decode_leg())
            return out

        start = time.perf_counter()
        got = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        wall = time.perf_counter() - start
        stats = p.stats
        await d.close()
        await p.close()
    same = sum(a == b for a, b in zip(want, got, strict=True))
    print(
        f"[5] disaggregated on CUDA (loopback): {same}/{len(want)} greedy outputs equal "
        f"colocated; wall {wall:.2f}s; {stats.transfers} transfers, "
        f"{stats.transfer_bytes / max(stats.transfers, 1) / 1024:.0f} KiB and "
        f"{1e3 * stats.transfer_seconds / max(stats.transfers, 1):.2f} ms each"
    )


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}


def _conforms(value: object) -> bool:
    """`STRUCTURED_SCHEMA`, checked by hand (the script needs no jsonschema)."""
    import re

    if not isinstance(value, dict) or not {"name", "age", "ok"} <= set(value):
        return False
    if set(value) - {"name", "age", "tags", "ok"}:
        return False  # strict: no key the schema does not name
    tags = value.get("tags", [])
    return (
        isinstance(value["name"], str)
        and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
        and type(value["ok"]) is bool
        and isinstance(tags, list)
        and len(tags) <= 3
        and all(t in ("a", "b", "c") for t in tags)
    )


async def check_structured() -> None:
    import json

    from stallfree import Engine, InvalidRequestError, SamplingParams, load_config

    runtime = {"device": "cuda", "overlap": True, "cpu_mirrors": True, "strict": True}
    spec = {"json": STRUCTURED_SCHEMA}
    cfg = load_config(
        model={"path": "bench-cpu", "dtype": "bfloat16"}, runtime={**runtime, "worker": "process"}
    )
    async with Engine(cfg) as engine:
        # compiling the schema and the worker's first matcher are not part of the figures
        await engine.complete("warm", SamplingParams(max_new_tokens=8, structured_outputs=spec))
        prompts = [f"Person {i}:" for i in range(32)]
        sampled = [
            SamplingParams(max_new_tokens=96, temperature=1.0, seed=i, structured_outputs=spec)
            for i in range(31)
        ]
        greedy = SamplingParams(max_new_tokens=96, structured_outputs=spec)
        start = time.perf_counter()
        results = await asyncio.gather(
            *(engine.complete(p, s) for p, s in zip(prompts, [*sampled, greedy], strict=True))
        )
        wall = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        plain = SamplingParams(max_new_tokens=max(tokens // len(prompts), 1), ignore_eos=True)
        start = time.perf_counter()
        free = await asyncio.gather(*(engine.complete(p, plain) for p in prompts))
        free_wall = time.perf_counter() - start
        free_tokens = sum(len(r.token_ids) for r in free)
        bad = []
        for r in results:
            try:
                ok = r.error is None and r.finish_reason == "stop" and _conforms(json.loads(r.text))
            except ValueError:
                ok = False
            if not ok:
                bad.append((r.finish_reason, r.error, r.text[:80]))
        stats = engine.core.scheduler.stats
        reads = engine.core.monitor.schedule_path_reads
        per_token = 1e6 * stats.grammar_seconds / max(stats.grammar_tokens, 1)
        print(
            f"[6] JSON schema on CUDA, worker process, strict overlap+mirrors: "
            f"{len(results) - len(bad)}/{len(results)} replies parse and conform; "
            f"{tokens / wall:.0f} tok/s with the schema, {free_tokens / free_wall:.0f} without; "
            f"grammar {per_token:.1f} us/token over {stats.grammar_tokens} tokens; "
            f"schedule-path reads {reads}; greedy reply {results[-1].text!r}"
        )
        assert not bad, f"replies that do not conform: {bad[:3]}"
        assert reads == 0 and stats.grammar_tokens > 0
    async with Engine(load_config(model={"path": "bench-cpu"}, runtime=runtime)) as engine:
        try:
            await engine.complete("x", SamplingParams(max_new_tokens=4, structured_outputs=spec))
        except InvalidRequestError as exc:
            print(f"[6] in-process CUDA stream: {exc.code}: {exc}")
            assert exc.code == "unsupported"
        else:
            raise AssertionError("the in-process CUDA stream constrained a reply it cannot mask")


KV_SHAPE = (4096, 8, 128)  # slots x KV heads x head dim: one layer's K of a 4096-token run
KV_SENDS = 10
DISAGG_TIMEOUT_S = 180.0


def _kv_like(i: int) -> torch.Tensor:
    """Tensor `i` of the transfer, the same in both processes (seeded, made on the CPU)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(KV_SHAPE, generator=g).to(torch.bfloat16)


def _disagg_rank(rank: int, port_q: Any, result_q: Any, done: Any, backend: str) -> None:
    """One side of the pair: rank 0 (prefill) hosts the store and sends, rank 1 receives.
    Tensor 0 is a warm-up (the NCCL communicator is set up at the first send); the rest are
    timed. Puts (rank, seconds, equal, first_s, error) on `result_q`. `backend` gloo (on the
    CPU) runs the same plumbing without a GPU."""
    try:
        import datetime

        import torch.distributed as dist

        from stallfree.disagg.dist import DistChannel

        cuda = backend == "nccl"
        dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(dev)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(dev)

        want = [_kv_like(i) for i in range(KV_SENDS + 1)]
        equal = None
        if rank == 0:
            # NOTE: a plain loopback TCPStore here: the servers meet through the bootstrap endpoint
            store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=60),
            )  # fmt: skip
            port_q.put(int(store.port))
            ch = DistChannel(store, 0, backend, dev)
            tensors = [t.to(dev) for t in want]
            start = time.perf_counter()
            ch.send(tensors[0])
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            for t in tensors[1:]:
                ch.send(t)
            sync()
            seconds = time.perf_counter() - start
            done.wait(DISAGG_TIMEOUT_S)  # until rank 1 has it all
        else:
            port = port_q.get(timeout=60)
            client = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
            )
            ch = DistChannel(client, 1, backend, dev)
            start = time.perf_counter()
            got = [ch.recv(KV_SHAPE, torch.bfloat16)]
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(KV_SENDS):
                got.append(ch.recv(KV_SHAPE, torch.bfloat16))
            sync()
            seconds = time.perf_counter() - start
            equal = sum(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
            done.set()
        ch.close()
        result_q.put((rank, seconds, equal, first, None))
    except BaseException:
        result_q.put((rank, None, None, None, traceback.format_exc()[-3000:]))
        done.set()


def check_disagg_nccl(backend: str = "nccl") -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        print("[5] disaggregation NCCL transport: skipped: NCCL between two ranks needs two GPUs")
        return
    ctx = mp.get_context("spawn")
    port_q, result_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_disagg_rank, args=(r, port_q, result_q, done, backend), daemon=True)
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + DISAGG_TIMEOUT_S
    try:
        while len(results) < 2:
            try:
                r = result_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            results[r[0]] = r
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    for rank in (0, 1):
        if rank not in results:
            print(
                f"[5] disaggregation NCCL transport: rank {rank} gave no result in "
                f"{DISAGG_TIMEOUT_S:.0f}s (exit code {procs[rank].exitcode})"
            )
        elif results[rank][4]:
            print(f"[5] disaggregation NCCL transport: rank {rank} failed:\n{results[rank][4]}")
    if len(results) < 2 or any(r[4] for r in results.values()):
        return
    nbytes = KV_SENDS * math.prod(KV_SHAPE) * 2  # bf16
    _, send_s, _, send_first, _ = results[0]
    _, recv_s, equal, recv_first, _ = results[1]
    status = "ok" if equal == KV_SENDS + 1 else "MISMATCH"
    where = "cuda:0 -> cuda:1" if backend == "nccl" else "cpu -> cpu"
    print(
        f"[5] disaggregation {backend} transport, DistChannel {where}: {KV_SENDS} x bf16 "
        f"{list(KV_SHAPE)} ({nbytes / KV_SENDS / 2**20:.0f} MiB each) after a warm-up: "
        f"{equal}/{KV_SENDS + 1} equal ({status}); receive {nbytes / recv_s / 1e9:.1f} GB/s, "
        f"send {nbytes / send_s / 1e9:.1f} GB/s; first tensor (communicator set-up) "
        f"{recv_first:.2f}s received, {send_first:.2f}s sent"
    )


def _each(label: str, fn: Any, *args: Any) -> bool:
    """Run one check; a failure prints its traceback and the script goes on to the next."""
    start = time.perf_counter()
    try:
        out = fn(*args)
        if asyncio.iscoroutine(out):
            asyncio.run(out)
    except BaseException as exc:  # one broken check must not hide the others' figures
        if isinstance(exc, KeyboardInterrupt):
            raise
        print(f"[{label}] FAILED after {time.perf_counter() - start:.1f}s:")
        traceback.print_exc(limit=8)
        return False
    print(f"    ({time.perf_counter() - start:.1f}s)", flush=True)
    return True


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a lent GPU machine")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    ok = [
        _each("1", check_stream_overlap),
        _each("2", check_sync_debug_mode),
        _each("3", check_workers),
        _each("5", check_disagg_loopback),
        _each("5", check_disagg_nccl),
        _each("6", check_structured),
    ]
    bench = Path(__file__).with_name("bench_overlap.py")
    cmd = [
        sys.executable,
        str(bench),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--model",
        "bench-cpu",
        "--batch-sizes",
        "8",
        "32",
        "128",
        "--steps",
        "64",
        "--repeats",
        "3",
        "--strict",
    ]
    print("[4]", " ".join(cmd[1:]), flush=True)
    rc = subprocess.call(cmd)
    return rc or (0 if all(ok) else 1)


if __name__ == "__main__":
    sys.exit(main())
