"""`--data-parallel-size` and its spellings fill the `replicas` section; what does not combine
with replicas is refused with one line and status 2 before any process starts."""

from __future__ import annotations

import pytest

from stallfree.entrypoints.cli import build_parser, config_from_args, main


@pytest.mark.parametrize("spelling", ["--data-parallel-size", "--dp-size", "-dp"])
def test_each_spelling_sets_the_replica_count(spelling):
    args = build_parser().parse_args(["serve", "tiny", spelling, "3"])
    assert config_from_args(args).replicas.data_parallel_size == 3


def test_the_policy_flag_and_the_defaults():
    args = build_parser().parse_args(["serve", "tiny", "--replica-policy", "round_robin"])
    replicas = config_from_args(args).replicas
    assert (replicas.policy, replicas.data_parallel_size) == ("round_robin", 1)


def test_the_environment_sets_it_too(monkeypatch):
    monkeypatch.setenv("STALLFREE_REPLICAS__DATA_PARALLEL_SIZE", "2")
    args = build_parser().parse_args(["serve", "tiny"])
    assert config_from_args(args).replicas.data_parallel_size == 2


def test_zero_replicas_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "tiny", "-dp", "0"])
    assert exit_.value.code == 2
    assert "not a positive whole number" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--disaggregation-mode", "prefill"], "does not combine with --disaggregation-mode"),
        (["--dist-init-addr", "127.0.0.1:29555"], "leave --nnodes and --dist-init-addr unset"),
    ],
)
def test_what_does_not_combine_is_refused_before_anything_starts(capsys, flags, says):
    assert main(["serve", "tiny", "--dp-size", "2", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stallfree: --data-parallel-size") and says in err
