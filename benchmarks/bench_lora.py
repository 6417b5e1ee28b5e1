"""Generation tokens/s with 0, 1 and 4 active LoRA adapters (issue 43).

A preset model (`--model`, random weights) and four random PEFT-format adapters of rank `--rank`
on every projection (written to a temporary directory); each round runs `--requests` greedy
requests of `--new-tokens` tokens spread evenly over its adapters: first on an engine with LoRA
off, then on one engine with LoRA on, with 0 (the base model's rows), 1 and 4 adapters active.
Each round runs its requests twice and times the second. Prints one line per round.

    python benchmarks/bench_lora.py --requests 16 --new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from stallfree import Engine, SamplingParams, load_config
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.loader import PRESETS

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, arch: ModelArchConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory on every projection of `arch`, written without peft."""
    out.mkdir(parents=True)
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(arch.num_layers):
        for t, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if t in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": TARGETS}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


async def one_round(engine: Engine, names: list[str | None], args: argparse.Namespace) -> float:
    """Generated tokens/s of `--requests` requests spread over `names` (None: the base)."""
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 4000 for j in range(args.prompt_len)] for i in range(args.requests)]
    seconds = 0.0
    for _ in range(2):  # the first round warms up: every adapter in its slot, every shape seen
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                engine.complete(p, params, lora_name=names[i % len(names)])
                for i, p in enumerate(prompts)
            )
        )
        seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    arch = PRESETS[args.model]
    paths = {f"a{i}": write_adapter(root / f"a{i}", arch, args.rank, i) for i in range(4)}
    base = {"model": {"path": args.model, "dtype": args.dtype}, "runtime": {"device": "cpu"}}
    modules = [{"name": n, "path": str(p)} for n, p in paths.items()]
    shape = f"({args.requests} requests x {args.new_tokens} tokens, rank {args.rank})"
    async with Engine(load_config(**base)) as engine:
        print(f"LoRA off:           {await one_round(engine, [None], args):8.1f} tokens/s {shape}")
    lora = {"lora_modules": modules, "max_loras": 4, "max_lora_rank": args.rank}
    async with Engine(load_config(**base, lora=lora)) as engine:
        for active in (0, 1, 4):
            names: list[str | None] = [f"a{i}" for i in range(active)] or [None]
            rate = await one_round(engine, names, args)
            print(f"LoRA on, {active} active: {rate:8.1f} tokens/s {shape}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--model", default="bench-cpu", choices=sorted(PRESETS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    asyncio.run(main(parser.parse_args()))
