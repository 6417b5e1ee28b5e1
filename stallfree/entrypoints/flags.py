"""One table of flags: each row is a flag (stallfree's spelling first, vLLM's and SGLang's
beside it), its help, and the setting it fills. The argparse flags, the help's defaults and the
flag -> setting mapping are all generated from the rows; this module holds the machinery, the
engine's and `generate`'s rows, and the value types."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import BaseModel

from stallfree.config import (
    CacheConfig,
    DisaggregationConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from stallfree.config.pooler import check_pooler_override
from stallfree.config.replicas import ReplicaConfig

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
    "replicas": ReplicaConfig,
    "lora": LoraConfig,
}
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
# vLLM's --dtype spellings that name the same type as one of ours
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ["auto", "float32", "float16", "bfloat16", "float64"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(CacheConfig.model_fields["kv_cache_dtype"].annotation)
LOAD_FORMATS = ["auto", "safetensors", "gguf"]
# a row's keywords for an on/off flag (--x and --no-x) whose unset value leaves the setting
SWITCH: dict[str, Any] = {"action": argparse.BooleanOptionalAction, "default": None}


@dataclass(frozen=True, slots=True)
class Flag:
    """One row: argparse's names and keywords, the help text, and `sets` ("section.key"), the
    setting the flag fills; its help then names that setting and its default (`unset` where
    the config's is None)."""

    names: tuple[str, ...]
    help: str
    sets: str = ""
    unset: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return str(self.kwargs.get("dest") or self.names[0].lstrip("-").replace("-", "_"))

    @property
    def help_text(self) -> str:
        if not self.sets:
            return self.help
        section, key = self.sets.split(".")
        return flag_help(self.help, section, key, self.unset)


def flag(*names: str, help: str, sets: str = "", unset: str | None = None, **kwargs: Any) -> Flag:
    return Flag(names, help, sets, unset, kwargs)


# the rows of a command, in order, under their group titles (None: the parser's own)
Table = Sequence[tuple[str | None, Sequence[Flag]]]


def add_flags(parser: argparse.ArgumentParser, table: Table) -> None:
    """The table's flags on `parser`; a group title met again adds to the group it names."""
    for title, rows in table:
        group: Any = parser if title is None else _group(parser, title)
        for row in rows:
            group.add_argument(*row.names, help=row.help_text or None, **row.kwargs)


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def settings_from_args(args: argparse.Namespace, *tables: Table) -> dict[str, dict[str, Any]]:
    """The settings the given flags fill, by section (a flag left out fills nothing). Flags of
    a section that takes two spellings fill it through their `SectionFlag` instead."""
    out: dict[str, dict[str, Any]] = {}
    for _, rows in (entry for table in tables for entry in table):
        for row in rows:
            value = getattr(args, row.dest, None)
            if row.sets and "to" not in row.kwargs and value is not None:
                section, key = row.sets.split(".")
                out.setdefault(section, {})[key] = value
    return out


class SectionFlag(argparse.Action):
    """A flag that fills part of a section two projects spell differently (speculative decoding,
    disaggregation). What each such flag said is kept under `dest` as {flag: {"value": text as
    written, "sets": settings}}, in command-line order (a flag given again moves to the end);
    `to` turns the text into the section's settings (ArgumentTypeError: a bad value), and
    `check` refuses a flag that contradicts those given before it (ValueError), each as a usage
    error while the flags are parsed."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        to: Callable[[Any], dict[str, Any]],
        check: Callable[[dict[str, Any], str, dict[str, Any]], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.to, self.check = to, check

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = dict(getattr(namespace, self.dest, None) or {})
        name = self.option_strings[0]
        try:
            entry = {"value": values, "sets": self.to(values)}
            self.check(given, name, entry)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        given.pop(name, None)
        given[name] = entry
        setattr(namespace, self.dest, given)


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


def _kv_cache_dtype(text: str) -> str:
    """vLLM's --kv-cache-dtype values that the KV cache stores (runtime/memory/kv_format.py)."""
    if text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(KV_CACHE_DTYPES)})"
        )
    return text


def _load_format(text: str) -> str:
    if text not in LOAD_FORMATS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not available: stallfree reads safetensors directories and GGUF files "
            f"(choose from {', '.join(LOAD_FORMATS)})"
        )
    return text


def memory_share(text: str) -> float:
    """A share of memory: over 0, at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"not a share of memory over 0 and at most 1: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


def pooler_override(text: str) -> dict[str, Any]:
    """vLLM's `--override-pooler-config` JSON object, checked."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({exc.msg})") from None
    try:
        return check_pooler_override(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def name_list(text: str) -> list[str]:
    """vLLM's JSON list (`'["https://a.example"]'`), or names separated by commas."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({exc.msg})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


# fmt: off
# (the tables are laid out one row per flag: the names and what the flag sets, then its help)
_MODEL = [
    flag("--model",
         help="a Hugging Face model directory, a .gguf file (weights, tokenizer and chat template "
         "all read from it), or a preset with random weights: tiny, bench-cpu (default: tiny; "
         "sets model.path)"),
    flag("--config",
         help="a TOML config file; flags win over STALLFREE_* variables, which win over it "
         "(default: none)"),
    flag("--device", choices=["auto", "cpu", "cuda"], sets="runtime.device",
         help="auto: CUDA when available, else the CPU-emulated stream"),
    flag("--dtype", type=_dtype, metavar="{" + ",".join([*DTYPES, *_DTYPE_ALIASES]) + "}",
         sets="model.dtype",
         help="weights and KV dtype; auto: the checkpoint's on CUDA, bfloat16 on a CPU that "
         "has it for models 512 or more wide, else float32 (half = float16, float = float32)"),
    flag("--enable-torch-compile", action="store_true", default=None, sets="runtime.torch_compile",
         help="torch.compile the decoder layers around attention at start-up (SGLang's flag)"),
    flag("--quantization", "-q", choices=["auto", "none", "int8", "int4", "gguf"],
         sets="model.quantization",
         help="linear weights kept packed: int8, int4, gguf (a GGUF file's own blocks); "
         "auto: gguf for a GGUF file on a CPU"),
    flag("--prepack-prompt-weights", **SWITCH, sets="model.prepack_prompt_weights",
         help="keep a second copy of each dense bfloat16 projection in oneDNN's blocked order "
         "for prompts of more than 64 tokens (CPUs with AMX): faster prompts, the dense weights' "
         "memory twice"),
    flag("--compact-decode-weights", nargs="?", const="beside",
         choices=["auto", "off", "beside", "only"],
         sets="model.compact_decode_weights",
         help="each dense bfloat16 linear also in 12 bits a value, losslessly, for decode steps "
         "(CPUs with AVX2 or AVX-512): the same outputs from about 0.75 of the bytes. beside "
         "(the flag alone): a second copy, the weights' memory 1.75x; only: instead of the "
         "dense weight, prompts decoding it a block at a time, the memory about 0.75x (one "
         "rank, no LoRA, no torch.compile); auto: only on a CPU with AVX2 but not AVX-512 "
         "BF16, where it applies"),
    flag("--model-impl", choices=["auto", "native", "transformers"], sets="model.model_impl",
         help="modelling code: native, or transformers (any causal LM it can build, with "
         "stallfree's paged attention; slower); auto: native for a supported architecture, "
         "else transformers"),
    flag("--runner", choices=["auto", "generate", "pooling"], sets="model.runner",
         help="generate (completions, chat) or pooling (/v1/embeddings; /v1/score and "
         "/v1/rerank on a cross-encoder); auto: pooling for an encoder architecture (BertModel, "
         "BertForSequenceClassification), else generate"),
    flag("--override-pooler-config", "--pooler-config", type=pooler_override,
         metavar="JSON", sets="model.override_pooler_config", unset="the checkpoint's",
         help="the pooling runner's pooling over the checkpoint's (vLLM's flag): "
         "'{\"pooling_type\": \"MEAN\", \"normalize\": false}'; pooling_type MEAN, CLS, "
         "LAST, MAX or MEAN_SQRT_LEN"),
    flag("--max-model-len", type=token_count, metavar="TOKENS", sets="model.max_context_len",
         unset="the model's own",
         help="cap on prompt + output tokens per request; 32k = 32000, 32K = 32768"),
    flag("--trust-remote-code", action="store_true", default=None,
         sets="model.trust_remote_code",
         help="let the transformers fallback run a checkpoint's own modelling code (auto_map); "
         "native models never run checkpoint code"),
    flag("--load-format", type=_load_format, metavar="{" + ",".join(LOAD_FORMATS) + "}",
         sets="model.load_format",
         help="the weights' format the model must have: safetensors (a directory) or gguf (a "
         ".gguf file); auto: whichever it is (vLLM's other formats are refused)"),
    flag("--kv-cache-dtype", type=_kv_cache_dtype, metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
         sets="cache.kv_cache_dtype",
         help="how the KV cache stores K and V: auto (the weights' dtype), fp8_e4m3 (fp8), "
         "fp8_e5m2, or int8 with a scale per token and KV head; quantized halves the bytes "
         "per token against bfloat16 (default: auto)"),
]
_SCHEDULE = [
    flag("--overlap", **SWITCH, sets="runtime.overlap",
         help="launch batch N+1 before processing batch N"),
    flag("--cpu-mirrors", **SWITCH, sets="runtime.cpu_mirrors",
         help="schedule from host mirrors; off is the legacy mode that syncs"),
    flag("--page-size", type=int, help="tokens per KV page", sets="cache.page_size"),
    flag("--max-total-tokens", type=int, sets="cache.max_total_tokens",
         help="KV slots in the device pool"),
    flag("--gpu-memory-utilization", type=memory_share, metavar="SHARE",
         sets="cache.gpu_memory_utilization", unset="none, --max-total-tokens sizes it",
         help="size the KV pool from memory instead (vLLM's flag): this share of the device's "
         "memory, on a CPU of the memory available at start, less what is in use and a step's "
         "activations; one in-process rank"),
    flag("--max-num-seqs", "--max-running-requests", dest="max_running_requests", type=int,
         metavar="N", sets="cache.max_running_requests",
         help="most requests running at once (vLLM's and SGLang's spellings)"),
    flag("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_prefill_tokens", type=int,
         metavar="TOKENS", sets="scheduler.max_prefill_tokens",
         help="prompt tokens one step may prefill, over all requests; it bounds each chunk too "
         "(vLLM's and SGLang's spellings)"),
    flag("--chunked-prefill-size", type=int, sets="scheduler.chunked_prefill_size",
         help="longest prompt chunk one request prefills in a step"),
    flag("--enable-mixed-chunk", **SWITCH, sets="scheduler.enable_mixed_chunk",
         help="one step carries the running decode rows and a prefill chunk, within the "
         "prefill token budget (SGLang's spelling); not with speculative decoding or HiSparse"),
    flag("--max-unread-tokens", type=int, metavar="TOKENS", sets="scheduler.max_unread_tokens",
         help="a streaming request whose reader is this far behind stops being decoded (it keeps "
         "its KV) until the reader catches up to half of it"),
    flag("--enable-prefix-caching", dest="prefix_caching", **SWITCH, sets="cache.prefix_caching",
         unset="on, off with HiSparse",
         help="share the KV of common prefixes"),
    flag("--disable-radix-cache", dest="prefix_caching", action="store_const", const=False,
         help="turn the prefix cache off, as --no-enable-prefix-caching does (SGLang's "
         "spelling; default: on, off with HiSparse)"),
    flag("--schedule-policy", choices=["fcfs", "lpm"], sets="scheduler.policy",
         help="admission order: fcfs (arrival) or lpm (longest cached prefix first)"),
]
# worker processes, tensor parallelism and the multi-node launch
_PARALLEL = [
    flag("--tp-size", "--tensor-parallel-size", "-tp", dest="tp_size", type=int, metavar="N",
         sets="parallel.tp_size",
         help="tensor-parallel ranks the model is sharded over, each in its own worker process "
         "(SGLang's and vLLM's spellings)"),
    flag("--worker", choices=["auto", "inprocess", "process"], sets="runtime.worker",
         help="where the model runs: inprocess (the scheduler's process) or process (worker "
         "processes); auto: process when --tp-size > 1"),
    flag("--step-timeout", dest="step_timeout_s", type=positive_seconds, metavar="SECONDS",
         sets="runtime.step_timeout_s", unset="--dist-timeout",
         help="worker processes: steps pending and none answered for this long means a hung "
         "worker; the engine fails closed"),
    flag("--nnodes", type=int, metavar="N", sets="parallel.nnodes",
         help="machines the tensor-parallel group spans; --tp-size counts the ranks of all"),
    flag("--node-rank", type=int, metavar="I", sets="parallel.node_rank",
         help="this machine's index; node 0 serves HTTP and runs the scheduler, every other node "
         "only runs its worker ranks and exits when node 0 stops them"),
    flag("--dist-init-addr", metavar="HOST:PORT", sets="parallel.dist_init_addr",
         unset="a free local port",
         help="where the ranks of every node meet (tcp://HOST:PORT works too); needed with "
         "--nnodes > 1"),
    flag("--dist-timeout", dest="dist_timeout_s", type=positive_seconds, metavar="SECONDS",
         sets="parallel.dist_timeout_s",
         help="how long the ranks' meeting or one collective may take before it fails"),
    flag("--dist-trusted-network", action="store_true", default=None,
         sets="parallel.trusted_network",
         help="the nodes' network is trusted (the ranks unpickle rank 0's step messages); a "
         "--dist-init-addr beyond loopback is refused without it (docs/tensor_parallel.md)"),
]
# the flags that choose and size the engine (`generate`, `serve` and `bench`)
ENGINE_FLAGS: Table = (("engine", _MODEL + _SCHEDULE), ("parallel", _PARALLEL))

# `generate`'s prompt and its sampling
SAMPLING_FLAGS: Table = (
    (None, [flag("prompt", help="")]),
    ("sampling", [
        flag("--max-new-tokens", type=int, default=64, help="tokens to generate at most"),
        flag("--temperature", type=float, default=0.0, help="0 is greedy"),
        flag("--top-p", type=float, default=1.0, help="nucleus sampling mass"),
        flag("--seed", type=int, help="seed of this request's sampling (default: none)"),
        flag("--ignore-eos", action="store_true", help="generate past the EOS token"),
    ]),
)
# fmt: on
