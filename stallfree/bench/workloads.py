"""Workloads: what each request asks for, and when it arrives. Seeded, so every mode sees the
same requests in the same order at the same offsets."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# ids below 256 are valid in every vocabulary, byte-level presets included, so random
# prompts can be sent as token ids to any OpenAI-compatible server.
TOKEN_ID_LIMIT = 256

Tokenize = Callable[[str], list[int]]


class WorkloadError(ValueError):
    """The workload cannot be built (bad file, impossible lengths)."""


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class WorkloadSpec:
    kind: str = "random"  # random | sharegpt | shared-prefix | custom | sonnet
    num_prompts: int = 200
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.5
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    prefix_groups: int = 4
    prefix_len: int = 256
    max_context_len: int | None = None
    seed: int = 0
    custom_output_len: int | None = None  # custom: lines without "output_tokens"
    sonnet_input_len: int = 550
    sonnet_output_len: int = 150
    sonnet_prefix_len: int = 200


def _lengths(rng: random.Random, target: int, ratio: float) -> int:
    """Uniform in [target * ratio, target], at least 1."""
    low = max(1, math.floor(target * ratio))
    return rng.randint(low, max(low, target))


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_ID_LIMIT) for _ in range(n)]


def random_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num_prompts):
        n_in = _lengths(rng, spec.input_len, spec.range_ratio)
        n_out = _lengths(rng, spec.output_len, spec.range_ratio)
        out.append(BenchRequest(_random_ids(rng, n_in), n_in, n_out))
    return out


def shared_prefix_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    """`prefix_groups` long shared prefixes ("system prompts"), each followed by a random question."""
    if spec.prefix_groups < 1:
        raise WorkloadError("--prefix-groups must be at least 1")
    rng = random.Random(spec.seed)
    prefixes = [_random_ids(rng, spec.prefix_len) for _ in range(spec.prefix_groups)]
    out = []
    for i in range(spec.num_prompts):
        question = _random_ids(rng, _lengths(rng, spec.input_len, spec.range_ratio))
        prompt = prefixes[i % spec.prefix_groups] + question
        out.append(
            BenchRequest(prompt, len(prompt), _lengths(rng, spec.output_len, spec.range_ratio))
        )
    rng.shuffle(out)
    return out


def _load_conversations(path: str) -> list[tuple[str, str]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WorkloadError(f"ShareGPT file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"cannot read ShareGPT file {path}: {exc}") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if isinstance(first, dict) and isinstance(second, dict):
            pairs.append((str(first.get("value", "")), str(second.get("value", ""))))
    return pairs


def sharegpt_requests(spec: WorkloadSpec, tokenize: Tokenize) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's length (or a fixed one) as the output."""
    if not spec.dataset_path:
        raise WorkloadError("--workload sharegpt needs --dataset-path FILE (ShareGPT JSON)")
    pairs = _load_conversations(spec.dataset_path)
    random.Random(spec.seed).shuffle(pairs)
    context = spec.max_context_len or 2048
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) == spec.num_prompts:
            break
        n_in = len(tokenize(prompt))
        n_out = spec.sharegpt_output_len or len(tokenize(reply))
        # same filter as the usual serving benchmarks: drop tiny and over-long pairs
        if n_in < 4 or n_out < 4 or n_in + n_out > context:
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
    if len(out) < spec.num_prompts:
        raise WorkloadError(
            f"{spec.dataset_path}: only {len(out)} usable conversations for "
            f"--num-prompts {spec.num_prompts}"
        )
    return out


def ramp_up_rate(
    strategy: str | None, start_rps: float, end_rps: float, index: int, total: int, rate: float
) -> float:
    """The request rate at request `index` of `total`, as `vllm bench serve` ramps it: linear
    `start + (end - start) * progress` or exponential `start * (end / start) ** progress`, with
    progress `index / (total - 1)`; `rate` itself without a strategy."""
    if strategy is None:
        return rate
    progress = index / max(total - 1, 1)
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    if strategy == "exponential":
        return float(start_rps * (end_rps / start_rps) ** progress)
    raise WorkloadError(f"unknown ramp-up strategy {strategy!r} (linear or exponential)")


def arrival_offsets(
    n: int,
    request_rate: float,
    seed: int,
    burstiness: float = 1.0,
    ramp_up: tuple[str, float, float] | None = None,
) -> list[float]:
    """Seconds after the start at which each request is sent; the first at 0.

    The gap after request i is drawn from a gamma distribution with shape `burstiness` and
    scale `1 / (rate_i * burstiness)` (vLLM's formula): its mean is 1 / rate_i and its squared
    coefficient of variation 1 / burstiness, so 1 is Poisson (exponential gaps, drawn as they
    always were), below 1 burstier, above 1 steadier. rate_i is `request_rate`, or the ramp-up
    `(strategy, start_rps, end_rps)` rate at request i (`ramp_up_rate`). An infinite rate sends
    everything at 0."""
    if burstiness <= 0:
        raise WorkloadError("--burstiness must be positive")
    if ramp_up is None and request_rate <= 0:
        raise WorkloadError("--request-rate must be positive (or inf)")
    if ramp_up is None and math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        rate = request_rate if ramp_up is None else ramp_up_rate(*ramp_up, i, n, request_rate)
        if math.isinf(rate):
            continue
        if rate <= 0:
            raise WorkloadError(f"the request rate at request {i} is {rate}; it must be positive")
        if burstiness == 1.0:
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
