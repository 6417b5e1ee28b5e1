"""Packaging: the base install is what embedding needs; the server, bench and GGUF are extras."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

BASE = {
    "torch",
    "pydantic",
    "pydantic-settings",
    "prometheus-client",
    "safetensors",
    "tokenizers",
    "llguidance",  # structured outputs in the embedded API (SamplingParams.structured_outputs)
    "uvloop",
    "tomli",
    "ninja",  # builds the native CPU kernels on first use (runtime/model/cpu_kernels.py)
    "huggingface_hub",  # a Hub id as the model (config/model_source.py); tokenizers needs it too
}
# what only the extras bring; an embedding user has none of them
EXTRA_ONLY = [
    "fastapi",
    "uvicorn",
    "httpx",
    "starlette",
    "rich",
    "matplotlib",
    "jinja2",
    "gguf",
    "partial_json_parser",
]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def test_base_dependencies_are_what_embedding_needs():
    project = PYPROJECT["project"]
    assert {_name(r) for r in project["dependencies"]} == BASE
    # torch is never pinned: the user's environment decides it
    torch_req = next(r for r in project["dependencies"] if _name(r) == "torch")
    assert "==" not in torch_req and "<" not in torch_req
    tomli = next(r for r in project["dependencies"] if _name(r) == "tomli")
    assert "python_version < '3.11'" in tomli


def test_extras_bring_the_server_the_bench_and_gguf():
    extras = {
        k: {_name(r) for r in v} for k, v in PYPROJECT["project"]["optional-dependencies"].items()
    }
    assert {"fastapi", "uvicorn", "httpx", "jinja2"} <= extras["server"]
    assert {"rich", "matplotlib", "httpx"} <= extras["bench"] | extras["server"]
    assert "stallfree" in extras["bench"]  # bench drives the server: it pulls the server extra
    assert "gguf" in extras["gguf"]
    assert "stallfree" in extras["test"]


BLOCKER = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = set(sys.argv[1].split(","))

    class Missing(importlib.abc.MetaPathFinder):
        # as if the package were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    """
)


def _run_without_extras(body: str) -> subprocess.CompletedProcess[str]:
    script = BLOCKER + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, ",".join([*EXTRA_ONLY, "numpy", "transformers"])],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


def test_the_engine_runs_with_only_the_base_install():
    proc = _run_without_extras(
        """
        import asyncio
        from stallfree import Engine, SamplingParams

        async def main():
            async with Engine(model={"path": "tiny"}, runtime={"device": "cpu"}) as engine:
                params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1)
                result = await engine.complete("hello", params)
                assert len(result.token_ids) == 4, result
                await engine.wait_idle()
                assert engine.pool_usage().all_free

        asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        print("loaded:", loaded)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded: []" in proc.stdout


def _cli_without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    """`stallfree ARGV` with every extra missing; prints the modules of the extras it loaded."""
    return _run_without_extras(
        f"""
        from stallfree.cli import main

        try:
            code = main({list(argv)!r})
        except SystemExit as exc:  # --version and --help exit through argparse
            code = exc.code
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        print("loaded:", loaded)
        sys.exit(code)
        """
    )


def test_version_and_generate_help_work_with_only_the_base_install():
    from stallfree import __version__

    proc = _cli_without_extras("--version")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == f"stallfree {__version__}"
    assert "loaded: []" in proc.stdout
    proc = _cli_without_extras("generate", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: stallfree generate")
    assert "--tensor-parallel-size" in proc.stdout and "loaded: []" in proc.stdout


def test_generate_runs_with_only_the_base_install():
    proc = _cli_without_extras(
        "generate", "hello", "--device", "cpu", "--max-new-tokens", "3", "--ignore-eos"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[length: " in proc.stderr and "3 completion tokens]" in proc.stderr
    assert "loaded: []" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (
            ["serve", "tiny", "--port", "0"],
            "stallfree serve needs the server extra (fastapi is not installed): "
            "pip install 'stallfree[server]'",
        ),
        (
            ["bench", "--num-prompts", "2"],
            "stallfree bench needs the bench extra (rich is not installed): "
            "pip install 'stallfree[bench]'",
        ),
    ],
)
def test_serve_and_bench_without_their_extra_say_which_one(argv, hint):
    proc = _cli_without_extras(*argv)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [hint]
    assert "Traceback" not in proc.stderr and "loaded: []" in proc.stdout
