"""stallfree against Hugging Face transformers: same checkpoints, same prompts, same greedy tokens.

    python benchmarks/bench_vs_hf.py [--models small bench-cpu] [--workloads uniform mixed]
        [--systems sf-overlap sf-plain hf-static hf-static-b32 hf-cb] [--repeats 3]
        [--threads 1] [--quick] [--json runs.json]

Both engines load the same random-weight Llama checkpoints (seeded, fp32, written in Hugging Face
format to a temporary directory) and generate exactly `new_tokens` tokens for every request
(EOS never stops a request early). Systems:

  sf-overlap     stallfree Engine, default config (overlap on, mirrors on), all requests at once
  sf-plain       the same with runtime.overlap=false
  hf-static      transformers `generate`, every request in one left-padded batch
  hf-static-b32  the same, in left-padded batches of 32 requests (arrival order)
  hf-cb          transformers `generate_batch` (continuous batching), when the version has it
  sf-hf          sf-overlap with model.model_impl=transformers: the same checkpoint through the
                 transformers fallback (transformers' modules, stallfree's paged attention);
                 not in the default set: `--systems sf-overlap sf-hf` compares it with native

Every measurement runs in a fresh subprocess (this script with `--worker`), with
`torch.set_num_threads(--threads)`, after one small warm-up generate; systems run round-robin,
`--repeats` rounds, and the table shows medians. Generated tokens per CPU-second use the
worker's `time.process_time()` (all its threads); peak RSS is the worker's VmHWM (the
high-water resident set of its own address space; `ru_maxrss` would include this parent's at
the fork). The first 4 requests' greedy tokens of each system are compared with hf-static.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT_TAG = "@@bench_vs_hf "
NUM_CHECKED = 4  # requests whose greedy tokens are compared across systems
BOS_ID, EOS_ID = 1022, 1023  # the tokenizer's specials; prompts use ids below 1000
PAD_ID = EOS_ID

MODELS: dict[str, dict[str, Any]] = {
    "small": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "initializer_range": 0.15,
    },
    "bench-cpu": {  # the dimensions of stallfree's bench-cpu preset
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "initializer_range": 0.08,
    },
    "moe-small": {  # a Mixtral: 8 experts of "small"'s width / 2, top 2 (moe.py)
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "initializer_range": 0.15,
    },
    # Gemma 2 / 3 (gemma.py) at "small"'s shape; a window of 128 that the mixed prompts outgrow
    "gemma2-small": {  # soft-capping at Gemma 2's defaults (50 / 30), every other layer sliding
        "model_type": "gemma2",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "sliding_window": 128,
        "query_pre_attn_scalar": 32,
        "initializer_range": 0.15,
    },
    "gemma3-small": {  # q/k norms, sliding and full layers alternating with their own RoPE
        "model_type": "gemma3_text",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "sliding_window": 128,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 32,
        "initializer_range": 0.15,
    },
    # Qwen3 and Phi-3 (llama.py) at "small"'s shape
    "qwen3-small": {  # per-head q/k RMSNorms, no qkv bias
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "initializer_range": 0.15,
    },
    # fused qkv_proj / gate_up_proj in the checkpoint (split at load); longrope with a
    # pretraining context of 512 (the engine's context stops there; the mixed prompts fit)
    "phi3-small": {
        "model_type": "phi3",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "original_max_position_embeddings": 512,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.02 * i for i in range(16)],
            "long_factor": [1.0 + 0.5 * i for i in range(16)],
        },
        "pad_token_id": PAD_ID,
        "initializer_range": 0.15,
    },
}
VOCAB_SIZE = 1024

# name -> (requests, (min prompt len, max prompt len), new tokens)
WORKLOADS: dict[str, tuple[int, tuple[int, int], int]] = {
    "uniform": (32, (32, 32), 64),
    "mixed": (128, (16, 256), 64),
}
QUICK_WORKLOADS: dict[str, tuple[int, tuple[int, int], int]] = {
    "uniform": (8, (16, 16), 8),
    "mixed": (12, (8, 48), 8),
}

SYSTEMS = ["sf-overlap", "sf-plain", "hf-static", "hf-static-b32", "hf-cb"]
ALL_SYSTEMS = [*SYSTEMS, "sf-hf"]
STATIC_CHUNK = 32


# ---------------------------------------------------------------------------- checkpoints


def write_checkpoint(out: Path, name: str, seed: int) -> Path:
    """A random model (a Llama unless its entry names another `model_type`) in Hugging Face
    format (fp32 safetensors) with a word-level tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = dict(MODELS[name])
    config = AutoConfig.for_model(
        spec.pop("model_type", "llama"),
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


def _write_tokenizer(out: Path) -> None:
    """Token i is the word `w{i}`; `<s>` and `</s>` are the last two ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(BOS_ID)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    assert tok.token_to_id("</s>") == EOS_ID
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 2048}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------- workloads


def workload_spec(name: str, quick: bool) -> tuple[int, tuple[int, int], int]:
    return (QUICK_WORKLOADS if quick else WORKLOADS)[name]


def make_prompts(name: str, quick: bool, seed: int) -> tuple[list[list[int]], int]:
    n, (lo, hi), new_tokens = workload_spec(name, quick)
    rng = random.Random(f"{seed}:{name}")
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, new_tokens


# ---------------------------------------------------------------------------- workers


def _measure(run: Any) -> dict[str, Any]:
    """Time `run()` (returns one token list per request): wall, CPU and peak RSS."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    outputs = run()
    return _figures(outputs, time.perf_counter() - wall0, time.process_time() - cpu0)


def _figures(outputs: list[list[int]], wall: float, cpu: float) -> dict[str, Any]:
    tokens = sum(len(o) for o in outputs)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "gen_tokens": tokens,
        "tok_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu if cpu > 0 else math.nan,
        "outputs": outputs,
    }


def worker_stallfree(
    model_dir: str,
    prompts: list[list[int]],
    new_tokens: int,
    overlap: bool,
    threads: int,
    model_impl: str = "auto",
) -> dict[str, Any]:
    import asyncio

    from stallfree import Engine, load_config

    n = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    cfg = load_config(
        model={"path": model_dir, "dtype": "float32", "model_impl": model_impl},
        runtime={
            "device": "cpu",
            "overlap": overlap,
            "cpu_mirrors": True,
            "stream_threads": threads,
        },
        cache={
            # NOTE: room for every request at once (plus the one-step overlap lag), so nothing is
            # ever retracted and the whole workload is one running batch.
            "max_total_tokens": prompt_tokens + n * (new_tokens + 2) + 256,
            "max_running_requests": n + 1,
        },
        scheduler={
            "max_prefill_tokens": max(prompt_tokens, 64),
            "chunked_prefill_size": max(max(len(p) for p in prompts), 2048),
        },
    )
    params = {"max_new_tokens": new_tokens, "ignore_eos": True}

    async def main() -> dict[str, Any]:
        engine = Engine(cfg)
        async with engine:
            await engine.complete(prompts[0][:8], {"max_new_tokens": 4, "ignore_eos": True})
            cpu0, wall0 = time.process_time(), time.perf_counter()
            results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            snap = engine.snapshot()
        outputs = [list(r.token_ids) for r in results]
        return {
            **_figures(outputs, wall, cpu),
            "retractions": snap.counters.retractions,
            "finish_reasons": sorted({str(r.finish_reason) for r in results}),
        }

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def _load_hf(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the saved default would still stop on EOS
    return model


def _static_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One left-padded `generate` call; exactly `new_tokens` greedy tokens per prompt."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=gen)
    return [[int(t) for t in row[width:]] for row in out]


def worker_hf_static(
    model_dir: str, prompts: list[list[int]], new_tokens: int, chunk: int | None
) -> dict[str, Any]:
    model = _load_hf(model_dir)
    _static_generate(model, [p[:8] for p in prompts[:2]], 4)  # warm-up
    size = chunk or len(prompts)

    def run() -> list[list[int]]:
        outputs: list[list[int]] = []
        for i in range(0, len(prompts), size):
            outputs.extend(_static_generate(model, prompts[i : i + size], new_tokens))
        return outputs

    return _measure(run)


def worker_hf_cb(
    model_dir: str, prompts: list[list[int]], new_tokens: int, cb_max_batch_tokens: int
) -> dict[str, Any]:
    import logging

    from transformers import GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model = _load_hf(model_dir)
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch")
    block_size = 32
    # NOTE: KV blocks for every request at once, with a spare block each for block rounding.
    num_blocks = sum(math.ceil((len(p) + new_tokens) / block_size) + 1 for p in prompts) + 8
    # NOTE: never below the request count, so every running request decodes in one batch. Small
    # budgets are fastest on a CPU: SDPA builds a [budget, budget + cache] mask for each batch.
    max_batch_tokens = max(cb_max_batch_tokens, len(prompts))
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_ID
    )
    kwargs: dict[str, Any] = {"generation_config": gen}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            page_size=block_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=len(prompts),
        )
    except ImportError:  # older transformers read the cache sizes from the GenerationConfig
        gen.num_blocks, gen.block_size, gen.max_batch_tokens = (
            num_blocks,
            block_size,
            max_batch_tokens,
        )

    def generate(batch: list[list[int]], tokens: int) -> list[list[int]]:
        gen.max_new_tokens = tokens
        result = model.generate_batch(batch, progress_bar=False, **kwargs)
        by_index: dict[int, list[int]] = {}
        for rid, output in result.items():
            by_index[int(str(rid).rsplit("_", 1)[-1])] = [int(t) for t in output.generated_tokens]
        if sorted(by_index) != list(range(len(batch))):
            raise RuntimeError(f"unexpected request ids from generate_batch: {sorted(result)[:4]}")
        return [by_index[i] for i in range(len(batch))]

    generate([p[:8] for p in prompts[:2]], 4)  # warm-up
    return _measure(lambda: generate(prompts, new_tokens))


def peak_rss_mb() -> float:
    """This process's peak resident set, in MiB.

    `VmHWM` belongs to the process's own address space; `ru_maxrss` would also count the parent's
    resident set at the fork, since Linux carries it across fork and exec.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_worker(args: argparse.Namespace) -> None:
    import torch

    system, _model, workload = args.worker
    torch.set_num_threads(args.threads)
    prompts, new_tokens = make_prompts(workload, args.quick, args.seed)
    model_dir = args.model_dir
    if system == "sf-overlap":
        res = worker_stallfree(model_dir, prompts, new_tokens, True, args.threads)
    elif system == "sf-plain":
        res = worker_stallfree(model_dir, prompts, new_tokens, False, args.threads)
    elif system == "sf-hf":
        res = worker_stallfree(model_dir, prompts, new_tokens, True, args.threads, "transformers")
    elif system == "hf-static":
        res = worker_hf_static(model_dir, prompts, new_tokens, None)
    elif system == "hf-static-b32":
        res = worker_hf_static(model_dir, prompts, new_tokens, STATIC_CHUNK)
    elif system == "hf-cb":
        res = worker_hf_cb(model_dir, prompts, new_tokens, args.cb_max_batch_tokens)
    else:
        raise SystemExit(f"unknown system {system!r}")
    outputs = res.pop("outputs")
    res["lengths_ok"] = all(len(o) == new_tokens for o in outputs)
    res["first_outputs"] = outputs[:NUM_CHECKED]
    res["maxrss_mb"] = peak_rss_mb()
    res["torch_threads"] = torch.get_num_threads()
    print(RESULT_TAG + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------- driver


def launch(
    args: argparse.Namespace, system: str, model: str, workload: str, model_dir: Path
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        system,
        model,
        workload,
        "--model-dir",
        str(model_dir),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--cb-max-batch-tokens",
        str(args.cb_max_batch_tokens),
    ]
    if args.quick:
        cmd.append("--quick")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    record: dict[str, Any] = {"system": system, "model": model, "workload": workload}
    started = time.time()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {**record, "ok": False, "error": f"timed out after {args.timeout}s"}
    record["started_at"], record["elapsed_s"] = started, time.time() - started
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {**record, "ok": False, "error": f"exit {proc.returncode}: {tail[:300]}"}
    return {**record, "ok": True, "error": None, **json.loads(lines[-1][len(RESULT_TAG) :])}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in runs if r.get("ok") and r.get(key) is not None]
    return statistics.median(values) if values else math.nan


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "—"


def print_cell(
    model: str, workload: str, quick: bool, systems: list[str], runs: list[dict[str, Any]]
) -> None:
    n, (lo, hi), new_tokens = workload_spec(workload, quick)
    prompts = f"{lo}" if lo == hi else f"U[{lo},{hi}]"
    print(
        f"\n== {model} / {workload}: {n} requests x {prompts}-token prompts -> {new_tokens} new tokens"
    )
    by_system = {s: [r for r in runs if r["system"] == s] for s in systems}
    ref = "sf-overlap"
    ref_tps = median_of(by_system.get(ref, []), "tok_s")
    ref_tpc = median_of(by_system.get(ref, []), "tok_per_cpu_s")
    header = f"{'system':<15}{'runs':>5}{'gen tok/s':>11}{'tok/CPU-s':>11}{'peak RSS':>11}{'sf/this tok/s':>15}{'sf/this tok/CPU-s':>19}  note"
    print(header)
    print("-" * len(header))
    for system in systems:
        rs = by_system[system]
        if not rs and system == "hf-static-b32":
            print(f"{system:<15}{'—':>5}{'':>71}  not run: {n} requests are one batch of 32")
            continue
        ok = [r for r in rs if r.get("ok")]
        tps, tpc = median_of(rs, "tok_s"), median_of(rs, "tok_per_cpu_s")
        rss = median_of(rs, "maxrss_mb")
        notes = sorted({r["error"] for r in rs if not r.get("ok")})
        if any(not r.get("lengths_ok", True) for r in ok):
            notes.append("some requests did not get exactly the asked new tokens")
        if any(r.get("retractions") for r in ok):
            notes.append("retractions happened")
        rss_text = f"{rss:.0f} MB" if not math.isnan(rss) else "—"
        tps_text = f"{tps:.1f}" if not math.isnan(tps) else "—"
        tpc_text = f"{tpc:.1f}" if not math.isnan(tpc) else "—"
        print(
            f"{system:<15}{len(ok):>3}/{len(rs):<1}{tps_text:>11}{tpc_text:>11}{rss_text:>11}"
            f"{_ratio(ref_tps, tps):>15}{_ratio(ref_tpc, tpc):>19}  {'; '.join(notes)}"
        )
    # greedy equality of the first requests, against hf-static
    base = next((r for r in by_system.get("hf-static", []) if r.get("ok")), None)
    if base is None:
        print("greedy check: no successful hf-static run to compare with")
        return
    for system in systems:
        if system == "hf-static":
            continue
        other = next((r for r in by_system[system] if r.get("ok")), None)
        if other is None:
            continue
        diffs = []
        for i, (a, b) in enumerate(
            zip(base["first_outputs"], other["first_outputs"], strict=False)
        ):
            at = first_difference(a, b)
            if at is not None:
                diffs.append(f"request {i} differs at token {at}")
        verdict = "OK" if not diffs else "MISMATCH (" + ", ".join(diffs) + ")"
        print(
            f"greedy {system} vs hf-static, first {len(base['first_outputs'])} requests: {verdict}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=ALL_SYSTEMS)
    p.add_argument("--repeats", type=int, default=3, help="round-robin rounds; medians shown")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every system")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")
    p.add_argument("--quick", action="store_true", help="small workloads, for a smoke test")
    p.add_argument("--json", type=Path, help="write every raw run here")
    p.add_argument(
        "--model-root", type=Path, help="keep the checkpoints here (default: a temp dir)"
    )
    p.add_argument(
        "--cb-max-batch-tokens",
        type=int,
        default=256,
        help="hf-cb token budget per batch (raised to the request count); 256 was fastest here",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per worker run")
    p.add_argument(
        "--worker", nargs=3, metavar=("SYSTEM", "MODEL", "WORKLOAD"), help=argparse.SUPPRESS
    )
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be at least 1")

    import torch
    import transformers

    print(
        f"bench_vs_hf: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} cores, threads={args.threads}, repeats={args.repeats}, "
        f"quick={args.quick}, seed={args.seed}"
    )
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    all_runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_vs_hf_") as tmp:
        root = args.model_root or Path(tmp)
        dirs = {m: write_checkpoint(root / m, m, args.seed) for m in args.models}
        sequence = 0
        for model in args.models:
            for workload in args.workloads:
                cell: list[dict[str, Any]] = []
                n = workload_spec(workload, args.quick)[0]
                # NOTE: with at most 32 requests, batches of 32 are the one batch of hf-static.
                systems = [
                    s for s in args.systems if not (s == "hf-static-b32" and n <= STATIC_CHUNK)
                ]
                for repeat in range(1, args.repeats + 1):
                    for system in systems:  # NOTE: round-robin, so a slow spell hits all alike
                        run = launch(args, system, model, workload, dirs[model])
                        run.update(repeat=repeat, sequence=sequence)
                        sequence += 1
                        cell.append(run)
                        status = f"{run['tok_s']:.1f} tok/s" if run["ok"] else run["error"]
                        print(
                            f"  [{model}/{workload} round {repeat}/{args.repeats}] {system}: {status}",
                            file=sys.stderr,
                            flush=True,
                        )
                print_cell(model, workload, args.quick, args.systems, cell)
                all_runs.extend(cell)
    print("\nload average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.json:
        payload = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "models": {m: MODELS[m] for m in args.models},
            "workloads": {w: workload_spec(w, args.quick) for w in args.workloads},
            "runs": all_runs,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"raw runs written to {args.json}")


if __name__ == "__main__":
    main()
