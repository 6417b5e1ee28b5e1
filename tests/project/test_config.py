from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stallfree.config import StallfreeConfig, load_config
from stallfree.config.doc import config_table


def test_precedence_kwargs_over_env_over_toml(tmp_path, monkeypatch):
    toml = tmp_path / "s.toml"
    toml.write_text("[cache]\npage_size = 8\nmax_total_tokens = 4096\n[runtime]\noverlap = false\n")
    monkeypatch.setenv("STALLFREE_CACHE__PAGE_SIZE", "16")
    cfg = load_config(toml, runtime={"cpu_mirrors": False})
    assert cfg.cache.page_size == 16  # env beats the file
    assert cfg.cache.max_total_tokens == 4096  # the file beats defaults
    assert cfg.runtime.overlap is False and cfg.runtime.cpu_mirrors is False
    assert load_config(toml, cache={"page_size": 2}).cache.page_size == 2  # kwargs beat env


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"cache": {"page_size": 0}}, "cache.page_size"),
        ({"runtime": {"device": "tpu"}}, "runtime.device"),
        ({"scheduler": {"new_token_ratio": 2}}, "scheduler.new_token_ratio"),
        ({"hisparse": {"top_k": 64, "device_buffer_size": 8}}, "device_buffer_size"),
        ({"cache": {"bogus": 1}}, "cache.bogus"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        StallfreeConfig(**overrides)


def test_bad_env_value_names_the_field(monkeypatch):
    monkeypatch.setenv("STALLFREE_RUNTIME__OVERLAP", "maybe")
    with pytest.raises(ValidationError, match=r"runtime\.overlap"):
        load_config()


def test_readme_configuration_table_is_current():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert config_table() in readme, "run `python -m stallfree.config.doc` and update the README"
