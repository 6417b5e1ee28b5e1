"""vLLM's spellings of the `serve` and `bench` flags: each maps to the same setting as
stallfree's own; help shows every default; a wrong flag shows its subcommand's usage; a wrong
model path or chat template is one line and exit status 2."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI

from stallfree.cli import build_parser, main
from stallfree.config import CacheConfig, SchedulerConfig, load_config
from stallfree.entrypoints.cli import HelpFormatter, config_from_args, subparsers, token_count
from stallfree.entrypoints.server.launch import load_chat_template, uvicorn_config
from tests.process_util import descendants, running


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def config(*argv: str):
    return config_from_args(parse(*argv))


# ---------------------------------------------------------------- serve


def test_vllm_serve_flags_map_to_the_config(tmp_path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = config(
        "serve",
        "bench-cpu",
        "--host",
        "0.0.0.0",
        "--port",
        "9100",
        "--max-model-len",
        "2K",
        "--dtype",
        "half",
        "--seed",
        "7",
        "--chat-template",
        str(template),
        "--served-model-name",
        "my-model",
        "--max-num-seqs",
        "12",
        "--max-num-batched-tokens",
        "1024",
        "--api-key",
        "secret",
        "--uvicorn-log-level",
        "warning",
        "--enable-log-requests",
        "--disable-uvicorn-access-log",
    )
    assert cfg.model.path == "bench-cpu"
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 9100)
    assert cfg.model.max_context_len == 2048
    assert cfg.model.dtype == "float16"
    assert cfg.model.seed == 7
    assert cfg.server.chat_template == str(template)
    assert cfg.server.served_model_name == "my-model"
    assert cfg.cache.max_running_requests == 12
    assert cfg.scheduler.max_prefill_tokens == 1024
    assert cfg.server.api_key == "secret"
    assert (cfg.server.uvicorn_log_level, cfg.server.log_level) == ("warning", "info")
    assert cfg.runtime.log_requests is True
    assert cfg.server.access_log is False
    assert config("serve", "--disable-log-requests").runtime.log_requests is False


def test_tool_and_reasoning_parser_flags() -> None:
    cfg = config(
        "serve",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_r1",
    )
    assert cfg.server.enable_auto_tool_choice is True
    assert (cfg.server.tool_call_parser, cfg.server.reasoning_parser) == ("hermes", "deepseek_r1")
    plain = config("serve")
    assert (plain.server.enable_auto_tool_choice, plain.server.tool_call_parser) == (False, None)
    with pytest.raises(Exception, match="needs tool_call_parser"):
        config("serve", "--enable-auto-tool-choice")


def test_vllm_and_stallfree_spellings_give_the_same_config() -> None:
    vllm = config(
        "serve",
        "tiny",
        "--max-num-seqs",
        "9",
        "--max-num-batched-tokens",
        "300",
        "--dtype",
        "float",
    )
    ours = config(
        "serve",
        "--model",
        "tiny",
        "--max-running-requests",
        "9",
        "--max-prefill-tokens",
        "300",
        "--dtype",
        "float32",
    )
    assert vllm == ours
    assert vllm.cache.max_running_requests == 9 and vllm.scheduler.max_prefill_tokens == 300
    # the same model twice is fine; the default config is untouched by no flags
    assert config("serve", "tiny", "--model", "tiny").model.path == "tiny"
    assert config("serve") == load_config()


def test_the_sampling_seed_of_generate_does_not_reseed_the_model() -> None:
    assert config("generate", "hi", "--seed", "5").model.seed == 0
    assert parse("generate", "hi", "--seed", "5").seed == 5


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("1M", 2**20)],
)
def test_max_model_len_shorthand(text: str, tokens: int) -> None:
    assert token_count(text) == tokens


@pytest.mark.parametrize("text", ["", "k", "-5", "1.3K", "0", "12x"])
def test_max_model_len_rejects_bad_counts(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        token_count(text)


def test_two_different_models_are_refused(capsys) -> None:
    assert main(["serve", "tiny", "--model", "bench-cpu"]) == 2
    err = capsys.readouterr().err
    assert "two models given: tiny and --model bench-cpu" in err and "Traceback" not in err


def _help_texts(command: str) -> dict[str, str]:
    parser = subparsers(build_parser()).choices[command]
    fmt = HelpFormatter(parser.prog)
    return {
        action.option_strings[0]: fmt._get_help_string(action) or ""
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_every_flag_has_help_with_its_default(command: str) -> None:
    missing = {flag: text for flag, text in _help_texts(command).items() if "default" not in text}
    assert not missing


def test_help_defaults_are_the_configs_own() -> None:
    texts = _help_texts("serve")
    assert f"(default: {CacheConfig().max_running_requests};" in texts["--max-num-seqs"]
    assert f"(default: {SchedulerConfig().max_prefill_tokens};" in texts["--max-num-batched-tokens"]
    assert "(default: the model's own;" in texts["--max-model-len"]
    assert "(default: 8000;" in texts["--port"] and "(default: 127.0.0.1;" in texts["--host"]
    assert ".gguf" in texts["--model"]
    out = subprocess.run(
        [sys.executable, "-m", "stallfree", "serve", "--help"], capture_output=True, text=True
    ).stdout
    assert "--max-num-seqs N, --max-running-requests N" in out and ".gguf" in out


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["serve", "--bogus"], "usage: stallfree serve"),
        (["serve", "tiny", "extra"], "usage: stallfree serve"),
        (["serve", "--dtype", "int8"], "usage: stallfree serve"),
        (["generate", "hi", "--max-num-seqs"], "usage: stallfree generate"),
        (["bench", "--dataset-name", "poems"], "usage: stallfree bench"),
        (["bench", "--bogus", "1"], "usage: stallfree bench"),
    ],
)
def test_a_wrong_flag_shows_the_usage_of_its_subcommand(argv, usage, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "usage: stallfree [-h]" not in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["positional", "flag"])
def test_a_missing_model_path_is_one_line(how, tmp_path) -> None:
    missing = str(tmp_path / "no-such-model.gguf")
    argv = [missing] if how == "positional" else ["--model", missing]
    proc = subprocess.run(
        [sys.executable, "-m", "stallfree", "serve", *argv, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert missing in lines[0] and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- --chat-template, --uvicorn-log-level


def test_chat_template_from_a_file_or_inline(tmp_path) -> None:
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(text)
    assert load_chat_template(str(path)) == text
    assert load_chat_template(text) == text
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="chat template file not found"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")


def test_a_bad_chat_template_stops_serve_with_one_line(tmp_path) -> None:
    missing = str(tmp_path / "missing.jinja")
    proc = subprocess.run(
        [sys.executable, "-m", "stallfree", "serve", "tiny", "--chat-template", missing],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"stallfree: chat template file not found: {missing}"


async def test_chat_template_replaces_the_models_own() -> None:
    import httpx

    from stallfree.entrypoints.server import create_app, start_server

    async def prompt_tokens(cfg) -> int:
        server = await start_server(create_app(cfg))
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                resp = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 2,
                    },
                )
            assert resp.status_code == 200, resp.text
            return int(resp.json()["usage"]["prompt_tokens"])
        finally:
            await server.stop()

    plain = config("serve", "tiny", "--chat-template", "{{ messages[0]['content'] }}")
    # the byte-level preset: one token per byte of the rendered template, no BOS added
    assert await prompt_tokens(plain) == len("hello")
    assert await prompt_tokens(config("serve", "tiny")) > len("hello")


def test_uvicorn_log_level_only_sets_uvicorns() -> None:
    both = config("serve", "--log-level", "debug")
    assert uvicorn_config(FastAPI(), both).log_level == "debug"
    split = config("serve", "--log-level", "debug", "--uvicorn-log-level", "error")
    assert uvicorn_config(FastAPI(), split).log_level == "error"
    assert split.server.log_level == "debug"


# ---------------------------------------------------------------- bench


def _checked(*argv: str) -> argparse.Namespace:
    from stallfree.bench.flag_checks import check_flags

    args = parse("bench", *argv)
    check_flags(args)
    return args


def test_vllm_bench_flags_map_to_the_same_settings() -> None:
    vllm = _checked(
        "--dataset-name",
        "prefix",
        "--random-input-len",
        "10",
        "--random-output-len",
        "5",
        "--prefix-repetition-num-prefixes",
        "3",
        "--prefix-repetition-prefix-len",
        "9",
        "--num-warmups",
        "0",
        "--disable-tqdm",
        "--request-rate",
        "4",
        "--max-concurrency",
        "2",
        "--num-prompts",
        "11",
    )
    ours = _checked(
        "--workload",
        "shared-prefix",
        "--input-len",
        "10",
        "--output-len",
        "5",
        "--prefix-groups",
        "3",
        "--prefix-len",
        "9",
        "--warmup-requests",
        "0",
        "--no-progress",
        "--request-rate",
        "4",
        "--max-concurrency",
        "2",
        "--num-prompts",
        "11",
    )
    assert vars(vllm) == vars(ours)
    assert (vllm.workload, vllm.input_len, vllm.output_len) == ("shared-prefix", 10, 5)
    assert _checked("--dataset-name", "prefix_repetition").workload == "shared-prefix"
    assert _checked("--dataset-name", "sharegpt").workload == "sharegpt"
    assert _checked("--dataset-name", "random").workload == "random"


def test_vllm_bench_target_flags() -> None:
    chat = _checked("--backend", "openai-chat", "--base-url", "http://h:1")
    assert (chat.backend, chat.base_url, chat.target) == ("openai-chat", "http://h:1", None)
    by_endpoint = _checked("--endpoint", "/v1/chat/completions", "--base-url", "http://h:1")
    assert by_endpoint.backend == "openai-chat"
    assert _checked("--endpoint", "/v1/completions").backend == "openai"
    assert _checked("--backend", "vllm", "--endpoint", "/v1/completions").backend == "vllm"
    # no server named: --backend picks a launched `stallfree serve`
    assert _checked("--backend", "openai-chat").target == "http"
    assert _checked().target is None and _checked().backend is None
    assert _checked("--host", "10.0.0.2", "--port", "9000").base_url == "http://10.0.0.2:9000"
    assert _checked("--port", "9000").base_url == "http://127.0.0.1:9000"
    saved = _checked("--result-dir", "out")
    assert saved.save_result is True and saved.result_dir == "out"
    assert _checked("--save-result", "--result-filename", "r.json").result_filename == "r.json"
    assert _checked().save_result is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "openai-chat", "--target", "inprocess"], "--backend picks an HTTP API"),
        (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "does not go with"),
        (["--host", "h", "--base-url", "http://h:1"], "not both"),
    ],
)
def test_bad_vllm_bench_combinations(argv, message, capsys) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "stallfree bench: error:" in err and message in err and "Traceback" not in err


# ---------------------------------------------------------------- worker processes, TP, multi-node


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["bench"]])
@pytest.mark.parametrize("spelling", ["--tp-size", "--tensor-parallel-size", "-tp"])
def test_tensor_parallel_spellings(command, spelling) -> None:
    cfg = config(*command, spelling, "2")
    assert cfg.parallel.tp_size == 2
    assert cfg.runtime.worker == "auto" and cfg.uses_worker_processes  # auto: process at tp 2


def test_worker_and_multi_node_flags_map_to_the_config() -> None:
    from stallfree.config import ParallelConfig

    cfg = config(
        "serve",
        "--worker",
        "process",
        "--tp-size",
        "4",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "10.0.0.1:29500",
        "--dist-timeout",
        "30",
        "--dist-trusted-network",
    )
    assert cfg.runtime.worker == "process"
    assert cfg.parallel == ParallelConfig(
        tp_size=4,
        nnodes=2,
        node_rank=1,
        dist_init_addr="10.0.0.1:29500",
        dist_timeout_s=30.0,
        trusted_network=True,
    )
    plain = config("serve")
    assert plain.parallel == ParallelConfig() and plain.runtime.worker == "auto"
    assert not plain.uses_worker_processes
    assert config("generate", "hi", "--worker", "process").uses_worker_processes
    texts = _help_texts("serve")
    assert "(default: 1; sets parallel.tp_size)" in texts["--tp-size"]
    assert "(default: auto; sets runtime.worker)" in texts["--worker"]
    assert "(default: 120.0; sets parallel.dist_timeout_s)" in texts["--dist-timeout"]


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--dist-timeout", "0"],
        ["serve", "--dist-timeout", "nan"],
        ["serve", "--worker", "thread"],
        ["generate", "hi", "-tp", "two"],
    ],
)
def test_bad_parallel_flags_are_usage_errors(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: stallfree {argv[0]}") and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["generate", "hi", "-tp", "2", "--nnodes", "2", "--node-rank", "1",
             "--dist-init-addr", "127.0.0.1:1"],
            "generate runs on node 0",
        ),
        (["serve", "--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "multiple of"),
        (["serve", "--tp-size", "2", "--nnodes", "2"], "needs parallel.dist_init_addr"),
        (["serve", "--tp-size", "2", "--worker", "inprocess"], "needs worker processes"),
        (["serve", "--node-rank", "1"], "must be below parallel.nnodes"),
        # issue 42, finding 15: step messages are pickled, so beyond loopback only when trusted
        (["serve", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:29500"],
         "--dist-trusted-network"),
        (["serve", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
          "--dist-init-addr", "tcp://node0:29500"], "beyond loopback"),
    ],
)  # fmt: skip
def test_bad_parallel_settings_are_refused_before_anything_starts(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_worker_node_with_a_missing_model_is_one_line(tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.run(
        [sys.executable, "-m", "stallfree", "serve", missing, "--tp-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", "127.0.0.1:1", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and missing in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_pool_sizes_are_the_engines_own() -> None:
    """A worker node sizes its pools with `pool_sizes`; they must be the scheduler node's."""
    from stallfree.runtime.engine import Engine
    from stallfree.runtime.model.loader import PRESETS
    from stallfree.runtime.scheduling.sizing import pool_sizes

    cfg = load_config(
        model={"path": "tiny", "max_context_len": 100},
        cache={"page_size": 4, "max_total_tokens": 90},
        runtime={"device": "cpu"},
    )
    max_context_len, num_kv_slots = pool_sizes(cfg, PRESETS["tiny"])
    assert (max_context_len, num_kv_slots) == (100, 96)  # 23 pages of 4 for 90 tokens, + 1
    async with Engine(cfg) as engine:
        assert engine.snapshot().max_context_len == max_context_len
        assert engine.pool_usage().kv_tokens_total == num_kv_slots - 4


def _listening_ports(pid: int) -> list[int] | None:
    try:
        import psutil
    except ImportError:
        return None
    conns = psutil.Process(pid).net_connections(kind="inet")
    return [c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
async def test_two_nodes_on_loopback_serve_what_one_process_does() -> None:
    """`serve --node-rank 1` runs rank 1 of a tp=2 group and no HTTP server; an engine on
    "node 0" in this process runs rank 0 and the scheduler. Greedy output equals the
    single-process engine's; when node 0 shuts down, node 1 exits by itself with 0 and leaves
    no process behind."""
    import os
    import socket

    from stallfree import Engine, SamplingParams

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
    parallel = {"tp_size": 2, "nnodes": 2, "dist_init_addr": addr, "dist_timeout_s": 60}
    node1 = subprocess.Popen(
        [sys.executable, "-m", "stallfree", "serve", "tiny", "--tp-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", addr, "--dist-timeout", "60", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    prompts = ["hello world", "the quick brown fox jumps over", "1 2 3"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    try:
        before = descendants(os.getpid())
        async with Engine(
            model={"path": "tiny"}, runtime={"device": "cpu"}, parallel=parallel
        ) as engine:
            split = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            (rank0,) = engine.snapshot().workers
            node1_procs = descendants(node1.pid)
            assert any(running(p) for p in node1_procs)  # rank 1 runs under node 1
            assert _listening_ports(node1.pid) in ([], None)  # no HTTP server there
            node0_workers = descendants(os.getpid()) - before
        assert rank0.rank == 0 and rank0.steps > 0 and rank0.comm_bytes > 0  # it all-reduced
        assert node1.wait(timeout=20) == 0  # node 0 stopped the group: node 1 follows
        out, err = node1.communicate()
        assert out.splitlines() == [
            f"stallfree: node 1 of 2 runs tensor-parallel rank 1 of 2 (meeting at {addr}); no "
            "HTTP server here, node 0 serves"
        ], (out, err[-2000:])
        assert "Traceback" not in err
        assert not [p for p in node1_procs | node0_workers if running(p)]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    async with Engine(model={"path": "tiny"}, runtime={"device": "cpu"}) as single:
        whole = await asyncio.gather(*(single.complete(p, params) for p in prompts))
    assert [r.token_ids for r in split] == [r.token_ids for r in whole]
