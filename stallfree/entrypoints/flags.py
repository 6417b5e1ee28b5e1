"""The engine's and the server's flags: the argparse groups, their value types, and help that
names each flag's default and the setting it fills."""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from pydantic import BaseModel

from stallfree.config import (
    CacheConfig,
    DisaggregationConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)

_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "runtime": RuntimeConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
    "metrics": MetricsConfig,
    "speculative": SpeculativeConfig,
    "disaggregation": DisaggregationConfig,
}
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
# vLLM's --dtype spellings that name the same type as one of ours
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ["auto", "float32", "float16", "bfloat16", "float64"]


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows every flag's default: taken from argparse unless the help text already
    names one (the engine flags name the config's own default, since theirs is None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or not action.option_strings or default is argparse.SUPPRESS:
            return text
        if default is False and action.nargs == 0:
            return text + " (default: off)"  # a switch
        if default is None or default is False:
            return text
        return text + " (default: %(default)s)"


def config_default(section: str, key: str) -> Any:
    """The built-in default of the setting `section.key`."""
    return _SECTIONS[section].model_fields[key].get_default(call_default_factory=True)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(value) if value else "none"
    return str(value) if value != "" else "none"


def flag_help(text: str, section: str, key: str, when_unset: str | None = None) -> str:
    """`text`, then the setting's default (`when_unset` where the config leaves it None) and
    the setting it fills."""
    value = config_default(section, key)
    shown = when_unset if value is None else _shown(value)
    return f"{text} (default: {shown}; sets {section}.{key})".replace("%", "%%")


def token_count(text: str) -> int:
    """A positive token count, with vLLM's shorthand: 32k = 32000, 32K = 32768, 1m = 10**6,
    1M = 2**20 (a decimal before a lowercase suffix, such as 1.5k, is allowed)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 32k, 32K)")
    number, suffix = m.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    value = float(number) * scale[suffix]
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a whole, positive token count: {text!r}")
    return int(value)


def _dtype(text: str) -> str:
    value = _DTYPE_ALIASES.get(text, text)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join([*DTYPES, *_DTYPE_ALIASES])})"
        )
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Worker processes, tensor parallelism and the multi-node launch (vLLM's and SGLang's
    spellings beside stallfree's)."""
    g = p.add_argument_group("parallel")
    _add_worker_flags(g)
    _add_multinode_flags(g)


def _add_worker_flags(g: argparse._ArgumentGroup) -> None:
    """How many tensor-parallel ranks, and where the model runs."""
    g.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        "-tp",
        dest="tp_size",
        type=int,
        metavar="N",
        help=flag_help(
            "tensor-parallel ranks the model is sharded over, each in its own worker process "
            "(SGLang's and vLLM's spellings)",
            "parallel",
            "tp_size",
        ),
    )
    g.add_argument(
        "--worker",
        choices=["auto", "inprocess", "process"],
        help=flag_help(
            "where the model runs: inprocess (the scheduler's process) or process (worker "
            "processes); auto: process when --tp-size > 1",
            "runtime",
            "worker",
        ),
    )
    g.add_argument(
        "--step-timeout",
        dest="step_timeout_s",
        type=positive_seconds,
        metavar="SECONDS",
        help=flag_help(
            "worker processes: steps pending and none answered for this long means a hung "
            "worker; the engine fails closed",
            "runtime",
            "step_timeout_s",
            "--dist-timeout",
        ),
    )


def _add_multinode_flags(g: argparse._ArgumentGroup) -> None:
    """A tensor-parallel group that spans machines: which one this is and where they meet."""
    g.add_argument(
        "--nnodes",
        type=int,
        metavar="N",
        help=flag_help(
            "machines the tensor-parallel group spans; --tp-size counts the ranks of all",
            "parallel",
            "nnodes",
        ),
    )
    g.add_argument(
        "--node-rank",
        type=int,
        metavar="I",
        help=flag_help(
            "this machine's index; node 0 serves HTTP and runs the scheduler, every other node "
            "only runs its worker ranks and exits when node 0 stops them",
            "parallel",
            "node_rank",
        ),
    )
    g.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help=flag_help(
            "where the ranks of every node meet (tcp://HOST:PORT works too); needed with "
            "--nnodes > 1",
            "parallel",
            "dist_init_addr",
            "a free local port",
        ),
    )
    g.add_argument(
        "--dist-timeout",
        dest="dist_timeout_s",
        type=positive_seconds,
        metavar="SECONDS",
        help=flag_help(
            "how long the ranks' meeting or one collective may take before it fails",
            "parallel",
            "dist_timeout_s",
        ),
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and size the engine (shared by `generate`, `serve` and `bench`).
    Where vLLM and SGLang spell one differently, both spellings work."""
    g = p.add_argument_group("engine")
    _add_model_flags(g)
    _add_overlap_flags(g)
    _add_pool_flags(g)
    _add_prefill_flags(g)
    _add_prefix_cache_flags(g)
    add_parallel_flags(p)


def _add_model_flags(g: argparse._ArgumentGroup) -> None:
    """The model, the config file, the device and the dtype, and the context cap."""
    g.add_argument(
        "--model",
        help="a Hugging Face model directory, a .gguf file (weights, tokenizer and chat template "
        "all read from it), or a preset with random weights: tiny, bench-cpu (default: tiny; "
        "sets model.path)",
    )
    g.add_argument(
        "--config",
        help="a TOML config file; flags win over STALLFREE_* variables, which win over it "
        "(default: none)",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help=flag_help(
            "auto: CUDA when available, else the CPU-emulated stream", "runtime", "device"
        ),
    )
    g.add_argument(
        "--dtype",
        type=_dtype,
        metavar="{" + ",".join([*DTYPES, *_DTYPE_ALIASES]) + "}",
        help=flag_help(
            "weights and KV dtype; auto: the checkpoint's on CUDA, bfloat16 on a CPU that "
            "has it for models 512 or more wide, else float32 (half = float16, float = float32)",
            "model",
            "dtype",
        ),
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        default=None,
        help=flag_help(
            "torch.compile the decoder layers around attention at start-up (SGLang's flag)",
            "runtime",
            "torch_compile",
        ),
    )
    g.add_argument(
        "--quantization",
        "-q",
        choices=["auto", "none", "int8", "int4", "gguf"],
        help=flag_help(
            "linear weights kept packed: int8, int4, gguf (a GGUF file's own blocks); "
            "auto: gguf for a GGUF file on a CPU",
            "model",
            "quantization",
        ),
    )
    g.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        help=flag_help(
            "modelling code: native, or transformers (any causal LM it can build, with "
            "stallfree's paged attention; slower); auto: native for a supported architecture, "
            "else transformers",
            "model",
            "model_impl",
        ),
    )
    g.add_argument(
        "--max-model-len",
        type=token_count,
        metavar="TOKENS",
        help=flag_help(
            "cap on prompt + output tokens per request; 32k = 32000, 32K = 32768",
            "model",
            "max_context_len",
            "the model's own",
        ),
    )


def _add_overlap_flags(g: argparse._ArgumentGroup) -> None:
    """The two switches `bench --compare` sets per mode."""
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=flag_help("launch batch N+1 before processing batch N", "runtime", "overlap"),
    )
    g.add_argument(
        "--cpu-mirrors",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=flag_help(
            "schedule from host mirrors; off is the legacy mode that syncs",
            "runtime",
            "cpu_mirrors",
        ),
    )


def _add_pool_flags(g: argparse._ArgumentGroup) -> None:
    """The KV pool's size and how many requests share it."""
    g.add_argument(
        "--page-size", type=int, help=flag_help("tokens per KV page", "cache", "page_size")
    )
    g.add_argument(
        "--max-total-tokens",
        type=int,
        help=flag_help("KV slots in the device pool", "cache", "max_total_tokens"),
    )
    g.add_argument(
        "--max-num-seqs",
        "--max-running-requests",
        dest="max_running_requests",
        type=int,
        metavar="N",
        help=flag_help(
            "most requests running at once (vLLM's and SGLang's spellings)",
            "cache",
            "max_running_requests",
        ),
    )


def _add_prefill_flags(g: argparse._ArgumentGroup) -> None:
    """How many prompt tokens a step prefills."""
    g.add_argument(
        "--max-num-batched-tokens",
        "--max-prefill-tokens",
        dest="max_prefill_tokens",
        type=int,
        metavar="TOKENS",
        help=flag_help(
            "prompt tokens one step may prefill, over all requests; it bounds each chunk too "
            "(vLLM's and SGLang's spellings)",
            "scheduler",
            "max_prefill_tokens",
        ),
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        help=flag_help(
            "longest prompt chunk one request prefills in a step",
            "scheduler",
            "chunked_prefill_size",
        ),
    )
    g.add_argument(
        "--max-unread-tokens",
        type=int,
        metavar="TOKENS",
        help=flag_help(
            "a streaming request whose reader is this far behind stops being decoded (it keeps "
            "its KV) until the reader catches up to half of it",
            "scheduler",
            "max_unread_tokens",
        ),
    )


def _add_prefix_cache_flags(g: argparse._ArgumentGroup) -> None:
    """The prefix cache, and the admission order that can follow it."""
    g.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=flag_help(
            "share the KV of common prefixes", "cache", "prefix_caching", "on, off with HiSparse"
        ),
    )
    g.add_argument(
        "--disable-radix-cache",
        dest="prefix_caching",
        action="store_const",
        const=False,
        help="turn the prefix cache off, as --no-enable-prefix-caching does (SGLang's "
        "spelling; default: on, off with HiSparse)",
    )
    g.add_argument(
        "--schedule-policy",
        choices=["fcfs", "lpm"],
        help=flag_help(
            "admission order: fcfs (arrival) or lpm (longest cached prefix first)",
            "scheduler",
            "policy",
        ),
    )


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """`generate`'s prompt and its sampling."""
    p.add_argument("prompt")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--seed", type=int, help="seed of this request's sampling (default: none)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past the EOS token")
