"""Settings: keyword arguments > environment (`STALLFREE_*`) > TOML file > defaults.

Nested sections use `__` in environment names, e.g. `STALLFREE_RUNTIME__OVERLAP=false`.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from stallfree.config.disagg import DisaggregationConfig
from stallfree.config.faults import FaultConfig
from stallfree.config.lora import LoraConfig
from stallfree.config.pooler import check_pooler_override
from stallfree.config.replicas import ReplicaConfig
from stallfree.config.sections import Section as _Section
from stallfree.config.server import MetricsConfig as MetricsConfig
from stallfree.config.server import ServerConfig as ServerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ModelConfig(_Section):
    path: str = Field(
        "tiny",
        description="Hugging Face model directory, a .gguf file, or a preset: tiny, bench-cpu",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float64"] = Field(
        "auto",
        description="Weights and KV dtype; auto = the checkpoint's on CUDA; on a CPU bfloat16 "
        "where it has AVX512-BF16 or AMX and the model's hidden size is 512 or more, else "
        "float32",
    )
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = Field(
        "auto",
        description="Linear weights kept packed on the CPU's integer kernels: int8 (per row) "
        "or int4 (groups of 32) from any checkpoint, gguf keeps a GGUF file's Q4_0/Q4_1/Q4_K "
        "(int4) and Q8_0 (int8) blocks; auto = gguf for a GGUF file on a CPU, else none",
    )
    prepack_prompt_weights: bool = Field(
        False,
        description="Keep a second copy of each dense bfloat16 projection of a native family "
        "in oneDNN's blocked order, which prompts of more than 64 tokens multiply (CPUs with "
        "AMX; the decode kernels read the first copy): prompt products about a fifth faster, "
        "the dense weights' memory twice",
    )
    compact_decode_weights: Literal["auto", "off", "beside", "only"] = Field(
        "auto",
        description="Each dense bfloat16 linear of a native family also in 12 bits a value, "
        "losslessly, which decode steps multiply (same outputs, about 0.75 of the weights' "
        "bytes read): beside = a second copy for steps of up to 4 rows (2 on AVX2-only CPUs), "
        "the weights 1.75x their memory; only = the compact form instead of the dense weight "
        "(prompts decode it a block of rows at a time), the weights about 0.75x their memory, "
        "one rank, no LoRA, no torch.compile; off = neither; auto = only on a CPU whose "
        "kernels are the AVX2 variant (no AVX-512 BF16) where only applies, else off "
        "(true / false: beside / off)",
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description="Which modelling code runs the model: native (stallfree's own families) "
        "or transformers (any causal LM transformers can build, through its modelling code "
        "with stallfree's paged attention; slower; one rank, dense weights, no HiSparse); "
        "auto = native for a supported architecture, else transformers if it can build it",
    )
    seed: int = Field(0, description="Seed for preset weights and unseeded sampling")
    max_context_len: int | None = Field(
        None, gt=1, description="Cap on prompt + output tokens; default: the model's own"
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer (and its chat template) from another directory, .gguf file or "
        "Hub id than the model's; default: the model's own",
    )
    trust_remote_code: bool = Field(
        False,
        description="Let the transformers fallback run a checkpoint's own modelling code "
        "(its auto_map); the native families never run checkpoint code",
    )
    load_format: Literal["auto", "safetensors", "gguf"] = Field(
        "auto",
        description="The weights' format the model must have: safetensors (a directory) or "
        "gguf (a .gguf file); auto = whichever the model is",
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description="generate: a causal LM serving completions and chat; pooling: an embedder "
        "(/v1/embeddings) or a cross-encoder (/v1/score, /v1/rerank); auto = pooling for an "
        "encoder architecture (BertModel, BertForSequenceClassification), else generate",
    )
    override_pooler_config: dict[str, Any] | None = Field(
        None,
        description="The pooling runner's pooling over the checkpoint's: pooling_type (MEAN, "
        "CLS, LAST, MAX, MEAN_SQRT_LEN) and normalize (true or false)",
    )

    @field_validator("compact_decode_weights", mode="before")
    @classmethod
    def _compact_switch(cls, value: Any) -> Any:
        # the setting was an on/off switch: on is the second copy
        if isinstance(value, bool):
            return "beside" if value else "off"
        return value

    @field_validator("override_pooler_config")
    @classmethod
    def _pooler_override(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_pooler_override(value)


class CacheConfig(_Section):
    page_size: int = Field(1, ge=1, le=256, description="Tokens per KV page")
    max_total_tokens: int = Field(16384, ge=16, description="KV slots in the device pool")
    max_running_requests: int = Field(256, ge=1, description="Request slots")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Size the KV pool from memory instead of max_total_tokens: this share "
        "of the device's memory (on a CPU, of the memory available at start), less what is "
        "in use and a step's activations; default: max_total_tokens",
    )
    prefix_caching: bool | None = Field(
        None,
        description="Share the KV of common prefixes across requests (a radix tree of pages); "
        "default: on, off with HiSparse (the two cannot run together)",
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"] = Field(
        "auto",
        description="How the KV cache stores K and V: auto = the weights' dtype; fp8_e4m3 "
        "(fp8) and fp8_e5m2 one byte per element; int8 one byte per element with a float32 "
        "scale per token and KV head (llama.cpp's q8_0)",
    )


class SchedulerConfig(_Section):
    policy: Literal["fcfs", "lpm"] = Field(
        "fcfs",
        description="Admission order: fcfs (arrival) or lpm (longest cached prefix first; "
        "fcfs when more than 128 wait)",
    )
    lpm_max_wait_s: float = Field(
        2.0,
        ge=0,
        allow_inf_nan=False,
        description="lpm: a request waiting longer than this goes first, in arrival order",
    )
    max_prefill_tokens: int = Field(4096, ge=1, description="Token budget of one prefill batch")
    chunked_prefill_size: int = Field(
        2048, ge=1, description="Longest prompt chunk one request prefills in a step"
    )
    enable_mixed_chunk: bool = Field(
        False,
        description="Let one step carry the running decode rows together with a prefill "
        "chunk, within the prefill token budget (SGLang's mixed chunk); not with speculative "
        "decoding or sparse attention",
    )
    new_token_ratio: float = Field(
        0.4,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Share of each running request's remaining max_new_tokens that admission reserves",
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=1,
        description="Reject new requests (overloaded, 503) beyond this many waiting; "
        "default: 4 x cache.max_running_requests",
    )
    max_unread_tokens: int = Field(
        128,
        ge=1,
        le=1 << 20,
        description="A streaming request whose reader is this many tokens behind stops being "
        "decoded (it keeps its KV) until the reader catches up to half of it",
    )


class RuntimeConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when available, else the CPU-emulated stream"
    )
    overlap: bool = Field(True, description="Launch batch N+1 before processing batch N")
    cpu_mirrors: bool = Field(
        True, description="Schedule from host mirrors; false is the legacy mode that syncs"
    )
    strict: bool = Field(False, description="host_read on the schedule path raises (tests)")
    check_mirrors: bool = Field(False, description="Assert mirror parity after every batch op")
    stream_threads: int = Field(
        0,
        ge=0,
        description="torch threads of the CPU stream worker; 0 = auto: 1 for models with hidden "
        "size under 512 (small ops lose to thread overhead), else every core",
    )
    torch_compile: bool = Field(
        False,
        description="torch.compile each decoder layer's work around attention (norms, "
        "projections, RoPE, MLP, residuals) with a dynamic token count, compiled at start-up; "
        "in-process model only",
    )
    max_consecutive_step_failures: int = Field(
        3, ge=1, description="Failed steps in a row before the engine fails closed"
    )
    step_timeout_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Worker processes: with steps pending and none answered for this long, the "
        "workers are taken as hung and the engine fails closed; default: parallel.dist_timeout_s",
    )
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Default per-request deadline; a request past it is aborted",
    )
    log_requests: bool = Field(
        False,
        description="Log each request's arrival and finish (id, tokens, reason, latency) at INFO",
    )
    structured_outputs_strict: bool = Field(
        True,
        description="JSON schemas of structured outputs and tools allow only the properties "
        "and tuple items they name, unless they say otherwise (additionalProperties); off: "
        "JSON schema's own default, where unnamed properties are allowed",
    )
    grammar_cache_bytes: int = Field(
        512 * 1024 * 1024,
        ge=0,
        description="Compiled structured-output grammars kept for reuse, capped by their "
        "estimated size in bytes (640 a character of grammar text; least recently used out "
        "first); 0 keeps none",
    )
    worker: Literal["auto", "inprocess", "process"] = Field(
        "auto",
        description="Where the model runs: inprocess (the scheduler's process) or process "
        "(worker processes, one per tensor-parallel rank); auto = process when "
        "parallel.tp_size > 1",
    )


class ParallelConfig(_Section):
    tp_size: int = Field(
        1, ge=1, le=64, description="Tensor-parallel ranks the model is sharded over"
    )
    nnodes: int = Field(1, ge=1, le=64, description="Machines the tensor-parallel group spans")
    node_rank: int = Field(
        0, ge=0, description="This machine's index; node 0 runs the scheduler and rank 0"
    )
    dist_init_addr: str | None = Field(
        None,
        description="host:port (or tcp://host:port) where the ranks meet; default: a free "
        "local port (one node only)",
    )
    dist_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="How long a collective or the ranks' meeting may take before it fails",
    )
    trusted_network: bool = Field(
        False,
        description="The network between the nodes is trusted: the ranks take each other's step "
        "messages as given (pickled), so anyone who can reach dist_init_addr could run code on "
        "every node. Required to meet beyond a loopback address",
    )


def _loopback(addr: str) -> bool:
    """Whether a `host:port` (or `tcp://host:port`) names a loopback address."""
    host = addr.split("://", 1)[-1].rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


class HisparseConfig(_Section):
    enabled: bool = Field(False, description="Host-offloaded top-k sparse attention")
    top_k: int = Field(64, ge=1, description="Tokens each sparse layer attends to per step")
    device_buffer_size: int = Field(128, ge=1, description="Device KV slots per request and layer")
    host_to_device_ratio: float = Field(
        1.0,
        ge=1.0,
        allow_inf_nan=False,
        description="Tokens the host pool holds, as a multiple of cache.max_total_tokens",
    )
    sparse_layers: list[int] | None = Field(None, description="Default: every layer but the first")
    min_sparse_len: int = Field(0, ge=0, description="Shorter sequences attend densely")

    @model_validator(mode="after")
    def _buffer_holds_top_k(self) -> HisparseConfig:
        if self.device_buffer_size < self.top_k:
            raise ValueError(
                f"device_buffer_size ({self.device_buffer_size}) must be >= top_k ({self.top_k})"
            )
        return self


SPEC_METHODS_UNSUPPORTED = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix")


class SpeculativeConfig(_Section):
    method: Literal["none", "ngram", "draft_model"] = Field(
        "none",
        description="Speculative decoding: ngram (prompt lookup, no model) or draft_model (a "
        "smaller model with the target's tokenizer); none = off",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="Draft tokens proposed per request and step (k)"
    )
    prompt_lookup_min: int = Field(
        1, ge=1, le=64, description="ngram: shortest suffix of the tokens that is looked up"
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="ngram: longest suffix of the tokens that is looked up"
    )
    draft_model: str | None = Field(
        None, description="draft_model: path of the draft checkpoint (HF directory or GGUF)"
    )
    adaptive: bool = Field(
        True,
        description="Per request, stop proposing while drafts are mostly rejected (speculating "
        "would cost more than it saves) and resume once its text repeats again",
    )
    cost_aware: bool = Field(
        True,
        description="adaptive on a CPU: measure what steps cost by token count and carry fewer "
        "drafts, or none, where that gives more tokens per second (high concurrency)",
    )
    min_acceptance_rate: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="adaptive: a request whose recent drafts are accepted below this rate "
        "stops proposing",
    )

    @model_validator(mode="before")
    @classmethod
    def _method_known(cls, data: Any) -> Any:
        if isinstance(data, dict):
            method = data.get("method")
            if isinstance(method, str) and method.lower() in SPEC_METHODS_UNSUPPORTED:
                raise ValueError(
                    f"speculative method {method!r} is not supported: stallfree has ngram "
                    "and draft_model (EAGLE-style, MTP and Medusa heads are not built)"
                )
        return data

    @model_validator(mode="after")
    def _window(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("speculative.method=draft_model needs speculative.draft_model")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class StallfreeConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STALLFREE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    hisparse: HisparseConfig = Field(default_factory=HisparseConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    replicas: ReplicaConfig = Field(default_factory=ReplicaConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)

    @model_validator(mode="after")
    def _consistent(self) -> StallfreeConfig:
        if self.cache.max_total_tokens < self.cache.page_size * 2:
            raise ValueError("cache.max_total_tokens must hold at least two pages")
        self._check_memory_sizing()
        par = self.parallel
        if par.tp_size % par.nnodes:
            raise ValueError(
                f"parallel.tp_size ({par.tp_size}) must be a multiple of parallel.nnodes "
                f"({par.nnodes}): every node runs the same number of ranks"
            )
        if par.node_rank >= par.nnodes:
            raise ValueError(
                f"parallel.node_rank ({par.node_rank}) must be below parallel.nnodes ({par.nnodes})"
            )
        if par.nnodes > 1 and not par.dist_init_addr:
            raise ValueError("parallel.nnodes > 1 needs parallel.dist_init_addr (host:port)")
        if par.dist_init_addr and not par.trusted_network and not _loopback(par.dist_init_addr):
            raise ValueError(
                f"parallel.dist_init_addr {par.dist_init_addr} is beyond loopback: the ranks of a "
                "multi-node group unpickle the step messages rank 0 sends, so whoever reaches "
                "that address first can run code on every node. Run the group on a trusted "
                "network only, and say so with --dist-trusted-network "
                "(parallel.trusted_network = true)"
            )
        if self.model.compact_decode_weights == "only" and (
            par.tp_size > 1 or self.lora.enable_lora or self.runtime.torch_compile
        ):
            raise ValueError(
                "model.compact_decode_weights=only keeps no dense weight, which tensor "
                "parallelism's partial products, LoRA's base products and torch.compile's "
                "traced products read; use it with tp_size 1, without LoRA and without "
                "runtime.torch_compile, or compact_decode_weights=beside"
            )
        if self.runtime.worker == "inprocess" and par.tp_size > 1:
            raise ValueError(
                "runtime.worker=inprocess runs one rank; parallel.tp_size > 1 needs worker "
                "processes (runtime.worker=process or auto)"
            )
        if self.uses_worker_processes and self.hisparse.enabled:
            raise ValueError(
                "hisparse.enabled does not compose with worker processes yet (its coordinator "
                "shares host memory with the model); use runtime.worker=inprocess and tp_size 1"
            )
        if self.model.model_impl == "transformers" and (
            self.uses_worker_processes or self.hisparse.enabled
        ):
            raise ValueError(
                "model.model_impl=transformers runs in-process on one rank without HiSparse; "
                "use runtime.worker=inprocess, tp_size 1 and hisparse.enabled=false"
            )
        spec = self.speculative
        if spec.enabled and self.hisparse.enabled:
            raise ValueError(
                "speculative decoding does not compose with hisparse.enabled yet (sparse "
                "attention selects keys for one query per request)"
            )
        self._check_disaggregation()
        self._check_lora()
        return self

    def _check_memory_sizing(self) -> None:
        if self.cache.gpu_memory_utilization is None:
            return
        if "max_total_tokens" in self.cache.model_fields_set:
            raise ValueError(
                "give one of cache.max_total_tokens (--max-total-tokens) and "
                "cache.gpu_memory_utilization (--gpu-memory-utilization): both size the KV pool"
            )
        for on, what in (
            (self.uses_worker_processes, "worker processes (each rank has its own memory)"),
            (self.hisparse.enabled, "hisparse.enabled (its KV lives in host memory)"),
        ):
            if on:
                raise ValueError(
                    f"cache.gpu_memory_utilization sizes the KV pool of one in-process rank; "
                    f"with {what} give cache.max_total_tokens (--max-total-tokens) instead"
                )

    def _check_disaggregation(self) -> None:
        dis = self.disaggregation
        if not dis.enabled:
            return
        for on, what in (
            (self.hisparse.enabled, "hisparse.enabled (its full KV lives in host memory)"),
            (self.speculative.enabled, "speculative decoding (drafts are not transferred)"),
        ):
            if on:
                raise ValueError(f"disaggregation does not compose with {what} yet")
        if dis.mode == "prefill" and self.uses_worker_processes:
            raise ValueError(
                "a prefill server runs one in-process rank (its KV is read on the scheduler's "
                "stream); tensor parallelism is for the decode side (disaggregation.mode=decode)"
            )

    def _check_lora(self) -> None:
        if not self.lora.enable_lora:
            return
        for on, what in (
            (self.runtime.torch_compile, "runtime.torch_compile"),
            (self.model.runner == "pooling", "the pooling runner"),
            (self.disaggregation.enabled, "disaggregation"),
            (self.hisparse.enabled, "hisparse.enabled"),
        ):
            if on:
                raise ValueError(f"LoRA adapters (lora.enable_lora) do not compose with {what} yet")

    def compact_weights(self) -> str:
        """`model.compact_decode_weights` as the loader takes it: `auto` is `off` where `only`
        does not apply (tensor parallelism, LoRA, torch.compile), else left to the loader,
        which knows the CPU's kernels."""
        mode = self.model.compact_decode_weights
        if mode == "auto" and (
            self.parallel.tp_size > 1 or self.lora.enable_lora or self.runtime.torch_compile
        ):
            return "off"
        return mode

    @property
    def uses_worker_processes(self) -> bool:
        worker = self.runtime.worker
        return worker == "process" or (worker == "auto" and self.parallel.tp_size > 1)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(toml_path: str | Path | None = None, **overrides: Any) -> StallfreeConfig:
    """Build a config from a TOML file, `STALLFREE_*` variables and keyword overrides.

    Overrides are nested dicts (`runtime={"overlap": False}`); they win over the environment,
    which wins over the file.
    """
    file_values: dict[str, Any] = {}
    if toml_path is not None:
        with open(toml_path, "rb") as f:
            file_values = tomllib.load(f)
    env_values = StallfreeConfig().model_dump(exclude_unset=True)
    merged = _deep_merge(_deep_merge(file_values, env_values), overrides)
    return StallfreeConfig(**merged)
