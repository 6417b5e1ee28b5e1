"""Models from where users keep them: a Hugging Face Hub id given as the model resolves to its
snapshot in the local Hub cache (HF_HOME, HF_HUB_OFFLINE), `org/name:FILE.gguf` and
`org/name:QUANT` pick a GGUF file of the repo, a path that exists stays a path, and an id that
cannot be had is a clear error (exit 2 on the CLI, ModelSourceError from Engine) that names no
path of this machine. The cache is written here in the Hub's own layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stallfree import Engine
from stallfree.cli import build_parser, main
from stallfree.config.model_source import ModelSourceError, hub_id, resolve_model
from stallfree.config.model_source import resolve_model_source as resolve
from stallfree.entrypoints.cli import config_from_args
from tests.engine_util import engine_config, run_greedy

REPO = "TinyOrg/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def write_hub_repo(home: Path, repo: str, files: dict[str, Path]) -> Path:
    """`files` (name in the repo -> a file here) as the Hub cache keeps a repo at `main`:
    hub/models--org--name/{blobs,snapshots/REV,refs/main}; returns the snapshot folder."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for i, (name, source) in enumerate(sorted(files.items())):
        blob = root / "blobs" / f"{i:040x}"
        shutil.copyfile(source, blob)
        (snapshot / name).symlink_to(blob)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, llama: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hub cache under a fresh HF_HOME holding the tiny Llama as REPO and two
    GGUF files in another repo; returns the Llama's snapshot folder."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {p.name: p for p in Path(llama).iterdir() if p.is_file()}
    snapshot = write_hub_repo(home, REPO, files)
    blob = tmp_path / "weights.gguf"
    blob.write_bytes(b"GGUF")
    write_hub_repo(home, "TinyOrg/tiny-gguf", {"tiny-Q8_0.gguf": blob, "tiny-Q4_K_M.gguf": blob})
    return snapshot


def test_hub_id_reads_as_one_only_when_no_path_exists(tmp_path, monkeypatch) -> None:
    assert hub_id("org/name") == ("org/name", None)
    assert hub_id("org/name:model-Q8_0.gguf") == ("org/name", "model-Q8_0.gguf")
    assert hub_id("org/name:Q4_K_M") == ("org/name", "Q4_K_M")
    for not_an_id in ("tiny", "bench-cpu", "/abs/dir", "./rel/dir", "a/b/c", "org/..", "x.gguf"):
        assert hub_id(not_an_id) is None, not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("org/name") is None  # a path that exists stays a path
    assert resolve_model("org/name") == "org/name"


def test_hub_id_resolves_from_the_offline_cache(hub: Path) -> None:
    assert resolve_model(REPO) == str(hub)
    config = resolve(engine_config(REPO))
    assert config.model.path == str(hub)
    # the id, not the cache folder, is what clients and metrics see
    assert config.server.model_name(config.model.path) == REPO
    named = resolve(engine_config(REPO, server={"served_model_name": "mine"}))
    assert named.server.served_model_name == "mine"


def test_serve_command_line_resolves_a_hub_id(hub: Path) -> None:
    args = build_parser().parse_args(["serve", REPO, "--tokenizer", REPO])
    config = resolve(config_from_args(args))
    assert (config.model.path, config.model.tokenizer) == (str(hub), str(hub))
    assert config.server.served_model_name == REPO


def test_gguf_file_of_a_repo_by_name_or_quant_tag(hub: Path) -> None:
    snapshot = Path(resolve_model("TinyOrg/tiny-gguf:tiny-Q8_0.gguf"))
    assert snapshot.name == "tiny-Q8_0.gguf" and snapshot.is_file()
    assert Path(resolve_model("TinyOrg/tiny-gguf:q4_k_m")).name == "tiny-Q4_K_M.gguf"
    with pytest.raises(ModelSourceError, match=r"no \.gguf file of the repo matches 'Q5_0'"):
        resolve_model("TinyOrg/tiny-gguf:Q5_0")
    with pytest.raises(ModelSourceError, match="more than one"):
        resolve_model("TinyOrg/tiny-gguf:tiny")


async def test_engine_runs_a_hub_id(hub: Path, llama: str) -> None:
    outputs = []
    for path in (REPO, llama):
        async with Engine(engine_config(path)) as engine:
            outputs.append(await run_greedy(engine, [[1, 2, 3, 4], [9, 8]], 6))
    assert outputs[0] == outputs[1] and [len(out) for out in outputs[0]] == [6, 6]


def test_generate_runs_a_hub_id(hub: Path, capsys) -> None:
    argv = ["generate", "hi", "--model", REPO, "--dtype", "float32", "--max-new-tokens", "3"]
    assert main([*argv, "--device", "cpu", "--ignore-eos"]) == 0
    assert "[length: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("TinyOrg/not-cached", "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"),
        ("TinyOrg/tiny-llama:model.gguf", "not in the local Hugging Face cache"),
    ],
)
def test_an_id_that_cannot_be_had_is_a_clear_error(hub: Path, capsys, model, reason) -> None:
    assert main(["generate", "hi", "--model", model, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stallfree: model ") and reason in err, err
    assert str(hub.parents[3]) not in err and "snapshots" not in err and "Traceback" not in err
    with pytest.raises(ModelSourceError, match=reason) as exc:
        Engine(engine_config(model))
    assert "hf_home" not in str(exc.value)


def test_load_format_must_match_the_model(hub: Path, capsys) -> None:
    gguf = "TinyOrg/tiny-gguf:tiny-Q8_0.gguf"
    assert resolve(engine_config(gguf, model={"load_format": "gguf"})).model.path.endswith(
        "tiny-Q8_0.gguf"
    )
    assert resolve(engine_config(REPO, model={"load_format": "safetensors"})).model.path
    with pytest.raises(ModelSourceError, match=r"load_format=gguf, but the model is not a \.gguf"):
        resolve(engine_config(REPO, model={"load_format": "gguf"}))
    assert main(["generate", "hi", "--model", gguf, "--load-format", "safetensors"]) == 2
    err = capsys.readouterr().err
    assert "load_format=safetensors, but the model is a .gguf file" in err
    assert "hf_home" not in err
