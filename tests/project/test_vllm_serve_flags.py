"""A copied `vllm serve` command line runs: --trust-remote-code (the transformers fallback runs a
checkpoint's own code only with it), --gpu-memory-utilization (the KV pool sized from memory),
--kv-cache-dtype (auto, fp8, fp8_e4m3, fp8_e5m2, int8; others refused, exit 2), --tokenizer (another directory's
tokenizer and chat template), --enable-prompt-tokens-details (a no-op) and --load-format
(auto, safetensors, gguf; vLLM's others refused, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stallfree import Engine
from stallfree.cli import build_parser, main
from stallfree.entrypoints.cli import config_from_args
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.model.loader import read_arch
from stallfree.runtime.scheduling.sizing import (
    activation_bytes,
    available_memory,
    memory_kv_tokens,
)
from tests.engine_util import engine_config, run_greedy


def config(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: stallfree serve") and "Traceback" not in err, err
    return err


def test_a_copied_vllm_command_line_parses() -> None:
    cfg = config(
        "m",
        "--trust-remote-code",
        "--gpu-memory-utilization",
        "0.85",
        "--kv-cache-dtype",
        "auto",
        "--tokenizer",
        "/tok",
        "--enable-prompt-tokens-details",
        "--load-format",
        "safetensors",
    )
    assert (cfg.model.trust_remote_code, cfg.model.tokenizer, cfg.model.load_format) == (
        True,
        "/tok",
        "safetensors",
    )
    assert cfg.cache.gpu_memory_utilization == 0.85
    # --enable-prompt-tokens-details and --kv-cache-dtype auto change nothing
    plain = config("m", "--gpu-memory-utilization", "0.85", "--trust-remote-code")
    plain.model.tokenizer, plain.model.load_format = "/tok", "safetensors"
    assert cfg == plain


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_quantized_kv_cache_dtypes_set_the_cache(value: str) -> None:
    assert config("m", "--kv-cache-dtype", value).cache.kv_cache_dtype == value


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-dtype", "fp8_inc"], "choose from auto, fp8, fp8_e4m3, fp8_e5m2, int8"),
        (["--kv-cache-dtype", "nvfp4"], "invalid choice: 'nvfp4'"),
        (["--load-format", "pt"], "'pt' is not available: stallfree reads safetensors"),
        (["--load-format", "dummy"], "choose from auto, safetensors, gguf"),
        (["--gpu-memory-utilization", "0"], "not a share of memory over 0 and at most 1"),
        (["--gpu-memory-utilization", "1.5"], "not a share of memory"),
        (["--gpu-memory-utilization", "nan"], "not a share of memory"),
    ],
)
def test_values_not_built_are_usage_errors(argv, message, capsys) -> None:
    err = usage_error(["serve", "m", *argv], capsys)
    assert f"argument {argv[0]}: " in err and message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-total-tokens", "4096"], "give one of cache.max_total_tokens"),
        (["--tp-size", "2"], "with worker processes (each rank has its own memory)"),
        (["--worker", "process"], "give cache.max_total_tokens (--max-total-tokens) instead"),
    ],
)
def test_memory_sizing_conflicts_are_refused(argv, message, capsys) -> None:
    assert main(["serve", "m", "--gpu-memory-utilization", "0.5", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stallfree: invalid configuration") and message in err, err


def test_prompt_tokens_details_help_says_it_is_a_no_op(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--enable-prompt-tokens-details accepted for vLLM's command lines and does nothing" in (
        help_text
    )


def test_kv_pool_sized_from_available_memory(llama: str) -> None:
    import torch

    arch = read_arch(llama)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    cpu = torch.device("cpu")
    cfg = engine_config(llama, cache={"max_running_requests": 64})
    reserve = activation_bytes(cfg, arch)

    def sized(share: float) -> int | None:
        cache = cfg.cache.model_copy(update={"gpu_memory_utilization": share})
        return memory_kv_tokens(cfg.model_copy(update={"cache": cache}), arch, torch.float32, cpu)

    # the activations' reserve and 4 MiB of KV: below every slot's full context (64 x 1024)
    share = (reserve + 4 * 1024 * 1024) / available_memory()
    before = available_memory()
    tokens = sized(share)
    after = available_memory()
    low, high = sorted(int(share * m - reserve) // per_token for m in (before, after))
    assert tokens is not None and low <= tokens <= high
    assert 4096 < tokens < 64 * 1024
    # a share too small for one full-length request is refused; unset, nothing is sized
    with pytest.raises(ValueError, match="leaves room for 0 KV tokens"):
        sized(1e-12)
    assert memory_kv_tokens(cfg, arch, torch.float32, cpu) is None


async def test_engine_kv_pool_follows_the_share(llama: str) -> None:
    # a whole share of a machine's memory holds far more than every slot's full context:
    # the pool is capped at that, and the engine runs
    cfg = engine_config(llama, cache={"gpu_memory_utilization": 0.5, "max_running_requests": 4})
    async with Engine(cfg) as engine:
        slots = engine.core.ctx.kv_cache.num_slots
        assert (
            slots == (4 * read_arch(llama).max_position_embeddings + 1) * 1
        )  # + the reserved page
        outputs = await run_greedy(engine, [[1, 2, 3], [4, 5]], 4)
    assert [len(out) for out in outputs] == [4, 4]


def test_too_small_a_share_exits_2(llama: str, capsys) -> None:
    argv = ["generate", "hi", "--model", llama, "--device", "cpu"]
    assert main([*argv, "--gpu-memory-utilization", "0.0000000001"]) == 2
    err = capsys.readouterr().err
    assert "stallfree: cache.gpu_memory_utilization=1e-10 leaves room for" in err, err


async def test_tokenizer_from_another_directory(llama: str, tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(Path(llama) / "tokenizer.json", tok / "tokenizer.json")
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    cfg = json.loads((Path(llama) / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    async with Engine(engine_config(llama, model={"tokenizer": str(tok)})) as engine:
        assert engine.tokenizer.chat_template == template
    async with Engine(engine_config(llama)) as engine:
        assert engine.tokenizer.chat_template != template


CUSTOM_CONFIG = """from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tinycustom"
"""
CUSTOM_MODEL = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


@pytest.fixture
def custom_code_model(llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny Llama as a checkpoint that brings its own code (auto_map), an architecture
    transformers does not know; its modules are cached under tmp_path, not the user's home."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    out = tmp_path / "custom"
    shutil.copytree(llama, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(
        model_type="tinycustom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    )
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (out / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    return str(out)


async def test_trust_remote_code_runs_a_checkpoints_own_code(custom_code_model, llama) -> None:
    with pytest.raises(ModelLoadError, match="--trust-remote-code") as exc:
        Engine(engine_config(custom_code_model))
    assert custom_code_model not in str(exc.value)
    prompts = [[1, 2, 3, 4], [7, 8]]
    outputs = []
    for path, trust in ((custom_code_model, True), (llama, False)):
        cfg = engine_config(path, model={"trust_remote_code": trust})
        async with Engine(cfg) as engine:
            assert type(engine.core.runner.executor.model).__name__ == (
                "TransformersForCausalLM" if trust else "LlamaForCausalLM"
            )
            outputs.append(await run_greedy(engine, prompts, 8))
    assert outputs[0] == outputs[1]


def test_worker_processes_take_the_tokenizer_too(llama: str, tmp_path: Path) -> None:
    # their grammar matchers tokenize with it: the spec carries it, the model's path otherwise
    from stallfree.runtime.execution.worker import worker_spec

    cfg = engine_config(llama, model={"tokenizer": str(tmp_path)}, runtime={"worker": "process"})
    assert worker_spec(cfg, 64, 32).tokenizer_path == str(tmp_path)
    assert worker_spec(engine_config(llama), 64, 32).tokenizer_path == llama
