"""`build_requests`, the one door to every workload, and the file and text workloads of
`vllm bench serve`: `--dataset-name custom` (JSON lines with a prompt each) and
`--dataset-name sonnet` (prompts built from poem lines, with a shared prefix)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.bench.workloads import (
    BenchRequest,
    Tokenize,
    WorkloadError,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)

if TYPE_CHECKING:
    from stallfree.bench.workloads import WorkloadSpec

# vLLM's opening line of every sonnet prompt
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"


def _custom_item(path: str, number: int, line: str) -> tuple[str, int | None]:
    """One line of a custom dataset: its prompt and its output length (None: not given)."""
    try:
        item: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path} line {number}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise WorkloadError(f'{path} line {number}: expected a JSON object with a "prompt"')
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f'{path} line {number}: "prompt" must be a non-empty string')
    n_out = item.get("output_tokens")
    if n_out is not None and (isinstance(n_out, bool) or not isinstance(n_out, int) or n_out < 1):
        raise WorkloadError(
            f'{path} line {number}: "output_tokens" must be a positive integer, not {n_out!r}'
        )
    return prompt, n_out


def load_custom(path: str) -> list[tuple[str, int | None]]:
    """Every non-blank line of a JSONL file, checked; errors name the line (1-based)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"custom dataset not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read custom dataset {path}: {exc}") from None
    items = [
        _custom_item(path, number, line)
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not items:
        raise WorkloadError(f"{path}: no prompts (one JSON object per line)")
    return items


def custom_requests(spec: WorkloadSpec, tokenize: Tokenize) -> list[BenchRequest]:
    """Each line's prompt, shuffled by the seed; its `output_tokens`, else `--custom-output-len`,
    else `--output-len`. Fewer lines than `--num-prompts` are drawn again at random (vLLM's
    oversampling)."""
    if not spec.dataset_path:
        raise WorkloadError("--dataset-name custom needs --dataset-path FILE.jsonl")
    items = load_custom(spec.dataset_path)
    rng = random.Random(spec.seed)
    rng.shuffle(items)
    if len(items) < spec.num_prompts:
        items += rng.choices(items, k=spec.num_prompts - len(items))
    default_out = spec.custom_output_len or spec.output_len
    out = []
    for prompt, n_out in items[: spec.num_prompts]:
        out.append(BenchRequest(prompt, len(tokenize(prompt)), n_out or default_out))
    return out


def _sonnet_lines(path: str | None) -> list[str]:
    if path is None:
        from stallfree.bench.sonnet_text import sonnet_lines

        return sonnet_lines()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        raise WorkloadError(f"sonnet file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read sonnet file {path}: {exc}") from None
    lines = [x for x in lines if x.strip()]
    if not lines:
        raise WorkloadError(f"{path}: no poem lines")
    return lines


def sonnet_requests(spec: WorkloadSpec, tokenize: Tokenize) -> list[BenchRequest]:
    """vLLM's sonnet workload: the base prompt, the first lines of the poem (the prefix every
    request shares, about `--sonnet-prefix-len` tokens with the base prompt), then random lines
    up to about `--sonnet-input-len` tokens; a prompt over that length is drawn again. Lengths
    are of the prompt as sent (vLLM measures it inside the chat template)."""
    lines = _sonnet_lines(spec.dataset_path)
    input_len, prefix_len = spec.sonnet_input_len, spec.sonnet_prefix_len
    base_offset = len(tokenize(SONNET_BASE_PROMPT))
    if input_len <= base_offset:
        raise WorkloadError(
            f"--sonnet-input-len must be above the base prompt's {base_offset} tokens"
        )
    if prefix_len > input_len:
        raise WorkloadError("--sonnet-prefix-len cannot be above --sonnet-input-len")
    avg_len = sum(len(tokenize(x)) for x in lines) / len(lines)
    num_input_lines = round((input_len - base_offset) / avg_len)
    num_prefix_lines = max(round((prefix_len - base_offset) / avg_len), 0)
    prefix = lines[:num_prefix_lines]
    rng = random.Random(spec.seed)
    out: list[BenchRequest] = []
    for _ in range(100 * spec.num_prompts):
        if len(out) == spec.num_prompts:
            break
        extra = rng.choices(lines, k=max(num_input_lines - num_prefix_lines, 0))
        prompt = SONNET_BASE_PROMPT + "".join(prefix + extra)
        n_in = len(tokenize(prompt))
        if n_in <= input_len:
            out.append(BenchRequest(prompt, n_in, spec.sonnet_output_len))
    if len(out) < spec.num_prompts:
        raise WorkloadError(
            f"could not draw sonnet prompts of at most {input_len} tokens; raise --sonnet-input-len"
        )
    return out


def build_requests(spec: WorkloadSpec, tokenize: Tokenize | None = None) -> list[BenchRequest]:
    if spec.num_prompts < 1:
        raise WorkloadError("--num-prompts must be at least 1")
    if spec.kind == "random":
        requests = random_requests(spec)
    elif spec.kind == "shared-prefix":
        requests = shared_prefix_requests(spec)
    elif spec.kind in ("sharegpt", "custom", "sonnet"):
        if tokenize is None:
            raise WorkloadError(f"the {spec.kind} workload needs a tokenizer")
        build = {"sharegpt": sharegpt_requests, "custom": custom_requests}
        requests = build.get(spec.kind, sonnet_requests)(spec, tokenize)
    else:
        raise WorkloadError(f"unknown workload {spec.kind!r}")
    _check_context(requests, spec.max_context_len)
    return requests


def _check_context(requests: list[BenchRequest], limit: int | None) -> None:
    if limit is None:
        return
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest > limit:
        raise WorkloadError(
            f"a request needs {longest} tokens (prompt + output) but the context is {limit}; "
            "lower --input-len/--output-len"
        )
