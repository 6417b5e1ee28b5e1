"""`stallfree bench`'s rows of the flag table: the target, the modes, the workload and the output
(the engine's own rows come from `stallfree.entrypoints.flags`), and their value types."""

from __future__ import annotations

import argparse
import math

from stallfree.bench.runner import MODE_KEYS
from stallfree.bench.slo import (
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    goodput_item,
    metadata_item,
    metric_percentiles,
    percentile_metrics,
)
from stallfree.entrypoints.flags import ENGINE_FLAGS, Table, add_flags, flag
from stallfree.entrypoints.spec_flags import SPECULATIVE_FLAGS

DESCRIPTION = """Load-test a stallfree engine (in process or over HTTP) or any OpenAI-compatible
server. With --compare, run the same seeded workload in each overlap mode and print one table
with a column per mode and each figure's ratio to the first (baseline) mode."""

BACKENDS = ("openai", "openai-chat", "vllm", "sglang", "openai-embeddings")
ENDPOINTS = {
    "/v1/completions": "openai",
    "/v1/chat/completions": "openai-chat",
    "/generate": "sglang",
    "/v1/embeddings": "openai-embeddings",
}
# `--workload` names and the `--dataset-name` spellings of `vllm bench serve` for the same sets
_WORKLOADS = {
    "random": "random",
    "sharegpt": "sharegpt",
    "shared-prefix": "shared-prefix",
    "prefix": "shared-prefix",
    "prefix_repetition": "shared-prefix",
    "custom": "custom",
    "sonnet": "sonnet",
}


def _workload_name(text: str) -> str:
    if text not in _WORKLOADS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(_WORKLOADS)})"
        )
    return _WORKLOADS[text]


def _tp_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(
            f"not a list of two or more different tensor-parallel sizes: {text!r} (e.g. 1,2)"
        )
    return sizes


# fmt: off
# (the tables are laid out one row per flag: its names and keywords, then its help)
# what is measured: an engine this command starts, or a server at a URL
_TARGET = [
    flag("--target", choices=["inprocess", "http"],
         help="default: http with --base-url or --backend, else inprocess"),
    flag("--base-url",
         help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (default: none)"),
    flag("--host",
         help="the server at http://HOST:PORT, another way to give --base-url (default: "
         "127.0.0.1 when --port is given, else none)"),
    flag("--port", type=int,
         help="the server's port, with --host (default: 8000 when --host is given, else none)"),
    flag("--backend", choices=BACKENDS,
         help="the API driven over HTTP: openai (and vllm) stream /v1/completions, openai-chat "
         "streams /v1/chat/completions, sglang streams SGLang's native /generate (stallfree "
         "serves it too), openai-embeddings posts each prompt to /v1/embeddings (requests/s, "
         "input tokens/s) (default: openai; without --base-url it picks --target http)"),
    flag("--endpoint", choices=list(ENDPOINTS),
         help="the API path, another way to choose --backend (default: the backend's)"),
    flag("--served-model-name", help="model id sent over HTTP (default: the server's first)"),
    flag("--api-key", help="bearer token for --base-url (default: none)"),
    flag("--startup-timeout", type=float, default=300.0,
         help="seconds to wait for a launched server"),
]
# the target flags that follow the engine's: settings of the engine this command starts
_ENGINE_TARGET = [
    flag("--stream-threads", type=int,
         help="torch threads of the CPU stream worker (runtime.stream_threads); on a 2-core "
         "machine 1 leaves the scheduler a core to overlap with (default: as configured)"),
    flag("--hisparse", choices=["off", "on", "both"],
         help="HiSparse off or on in every mode (default: as configured); "
         "both doubles the modes under --compare"),
    flag("--compare-prefix-caching", action="store_true",
         help="under --compare, run every mode with the prefix cache off and on (doubles the "
         "modes); the table shows the hit rate"),
]
# which engine modes run, and how many times each
_MODES = [
    flag("--compare", action="store_true",
         help="run every mode: overlap off; overlap with mirrors off; overlap with mirrors on"),
    flag("--modes",
         help=f"comma list of modes for --compare, from: {', '.join(MODE_KEYS)} (default: all)"),
    flag("--compare-workers", action="store_true",
         help="run every mode with the model in process (runtime.worker=inprocess) and then in "
         "a worker process (runtime.worker=process), the same workload interleaved; the table "
         "adds per-rank step time, the all-reduce share and the bytes sent per step"),
    flag("--compare-tp", type=_tp_sizes, metavar="N,M[,...]",
         help="run every mode at each tensor-parallel size (parallel.tp_size), in worker "
         "processes at every size unless --worker says otherwise (default: none)"),
    flag("--repeats", type=int, default=None,
         help="run the whole workload N times per mode, the modes interleaved (A B C, A B C, "
         "...), and report each figure's median over a mode's runs and the spread of output "
         "throughput (default: 3 with --compare, --compare-workers or --compare-tp, else 1)"),
]
# where the requests come from, and how many
_DATASET = [
    flag("--workload", "--dataset-name", type=_workload_name, default="random",
         metavar="{random,sharegpt,shared-prefix,custom,sonnet}",
         help="the requests (default: random); vLLM's --dataset-name prefix and "
         "prefix_repetition mean shared-prefix"),
    flag("--dataset-path",
         help="ShareGPT JSON file for sharegpt, JSON lines file for custom, poem text for sonnet "
         "(default: none; sonnet: the Shakespeare sonnets built in)"),
    flag("--custom-output-len", type=int,
         help='custom: output tokens of a line without "output_tokens" (default: --output-len)'),
    flag("--sonnet-input-len", type=int, default=550,
         help="sonnet: most prompt tokens per request (default: 550)"),
    flag("--sonnet-output-len", type=int, default=150,
         help="sonnet: output tokens per request (default: 150)"),
    flag("--sonnet-prefix-len", type=int, default=200,
         help="sonnet: tokens of the prefix every prompt shares (default: 200)"),
    flag("--tokenizer",
         help="tokenizer (HF directory or preset) that measures ShareGPT prompts; default: "
         "--model"),
    flag("--sharegpt-output-len", type=int,
         help="fixed output length instead of each reply's (default: the reply's)"),
    flag("--num-prompts", type=int, default=200, help="requests in the workload"),
]
# the prompt, output and shared-prefix lengths
_LENGTHS = [
    flag("--input-len", "--random-input-len", "--prefix-repetition-suffix-len", dest="input_len",
         type=int, default=256,
         help="random prompt tokens (upper bound); shared-prefix: the tokens after the prefix"),
    flag("--output-len", "--random-output-len", "--prefix-repetition-output-len", dest="output_len",
         type=int, default=128, help="output tokens (upper bound)"),
    flag("--random-range-ratio", type=float, default=0.5,
         help="lengths are uniform in [len*ratio, len] (not vLLM's "
         "[len*(1-ratio), len*(1+ratio)])"),
    flag("--prefix-groups", "--prefix-repetition-num-prefixes", dest="prefix_groups", type=int,
         default=4, help="shared-prefix: number of distinct prefixes"),
    flag("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=int, default=256,
         help="shared-prefix: tokens in each prefix"),
]
# when the requests arrive, and how they sample
_ARRIVAL = [
    flag("--request-rate", type=float, default=math.inf,
         help="arrivals per second, Poisson unless --burstiness says otherwise (default: inf, "
         "all at once)"),
    flag("--burstiness", type=float, default=1.0,
         help="with a finite --request-rate or a ramp-up: gaps between arrivals are gamma "
         "distributed with this shape, scale 1/(rate*burstiness); 1 is Poisson, lower is "
         "burstier, higher steadier (default: 1.0)"),
    flag("--ramp-up-strategy", choices=["linear", "exponential"],
         help="raise the request rate over the run from --ramp-up-start-rps to "
         "--ramp-up-end-rps, instead of --request-rate (default: none, a fixed rate)"),
    flag("--ramp-up-start-rps", type=float,
         help="the rate at the first request, with --ramp-up-strategy (default: none)"),
    flag("--ramp-up-end-rps", type=float,
         help="the rate at the last request, with --ramp-up-strategy (default: none)"),
    flag("--max-concurrency", type=int, help="most requests in flight at once (default: no cap)"),
    flag("--warmup-requests", "--num-warmups", dest="warmup_requests", type=int, default=2,
         help="short requests sent before measuring"),
    flag("--seed", type=int, default=0, help="seed of the workload and the arrivals"),
    flag("--ignore-eos", action="store_true", help="always generate the full output length"),
    flag("--temperature", type=float, default=0.0, help="0 is greedy"),
]
# where the figures go besides the table
_OUTPUT = [
    flag("--output-json",
         help="write every figure and the full configuration here (default: none)"),
    flag("--save-result", action="store_true",
         help="write the same JSON to --result-dir/--result-filename, as vLLM names it"),
    flag("--result-dir",
         help="directory for --save-result, created if missing (default: the current one)"),
    flag("--result-filename",
         help="file name for --save-result (default: "
         "BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json)"),
    flag("--goodput", nargs="+", type=goodput_item, metavar="KEY:MS",
         help="service level objectives, from ttft:MS tpot:MS e2el:MS: request_goodput counts "
         "the requests per second meeting all given (default: none, no goodput)"),
    flag("--percentile-metrics", type=percentile_metrics,
         default=percentile_metrics(DEFAULT_PERCENTILE_METRICS), metavar="METRICS",
         help="comma list from ttft, tpot, itl, e2el whose --metric-percentiles are reported "
         f"(default: {DEFAULT_PERCENTILE_METRICS})"),
    flag("--metric-percentiles", type=metric_percentiles,
         default=metric_percentiles(DEFAULT_METRIC_PERCENTILES), metavar="PERCENTILES",
         help="comma list of percentiles, e.g. 50,90,99.9, written as p50_ttft_ms, ... "
         f"(default: {DEFAULT_METRIC_PERCENTILES})"),
    flag("--save-detailed", action="store_true",
         help="add vLLM's per-request lists to the result: ttfts, itls, input_lens, output_lens, "
         "errors, generated_texts (default: off)"),
    flag("--metadata", nargs="+", type=metadata_item, metavar="KEY=VALUE",
         help="pairs written into the result file as they are (default: none)"),
    flag("--label",
         help="a name stored as label in the result, and the first part of the --save-result "
         "file name (default: the backend)"),
    flag("--plot",
         help="write a PNG: latency distributions, stall time and idle per mode (default: none)"),
    flag("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
         help="no progress bar"),
]
# fmt: on
# `vllm bench serve`'s spellings work beside bench's own; the engine's rows are the base config
# of every mode
BENCH_FLAGS: Table = (
    ("target", _TARGET),
    *ENGINE_FLAGS,
    *SPECULATIVE_FLAGS,
    ("target", _ENGINE_TARGET),
    ("modes", _MODES),
    ("workload", _DATASET + _LENGTHS + _ARRIVAL),
    ("output", _OUTPUT),
)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """`stallfree bench`'s flags."""
    add_flags(p, BENCH_FLAGS)
