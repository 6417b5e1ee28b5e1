"""The speculative decoding flags: vLLM's `--speculative-config JSON` and SGLang's
`--speculative-*` flags fill the one `speculative` section the same way on `serve`, `generate`
and `bench`; unsupported methods, bad values and spellings that contradict each other are usage
errors of the subcommand; flags that would do nothing are refused before anything starts."""

from __future__ import annotations

import argparse
import json

import pytest

from stallfree.cli import build_parser, main
from stallfree.config import SpeculativeConfig
from stallfree.entrypoints.cli import HelpFormatter, config_from_args, subparsers

NGRAM_JSON = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
DRAFT_JSON = '{"method": "draft_model", "model": "/path", "num_speculative_tokens": 3}'
COMMANDS = [["serve"], ["generate", "hi"], ["bench"]]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def spec(*argv: str) -> SpeculativeConfig:
    return config_from_args(parse(*argv)).speculative


def usage_error(argv: list[str], capsys) -> str:
    """The one-line error of a command line that argparse refuses with its subcommand's usage."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    command = argv[0]
    assert err.startswith(f"usage: stallfree {command}"), err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith(f"stallfree {command}: error:")]
    return line


# ---------------------------------------------------------------- vLLM's --speculative-config


def test_vllm_ngram_config() -> None:
    assert spec("serve", "--speculative-config", NGRAM_JSON) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4
    )


def test_vllm_draft_model_config_maps_model_to_draft_model() -> None:
    cfg = spec("serve", "--speculative-config", DRAFT_JSON)
    assert cfg == SpeculativeConfig(
        method="draft_model", draft_model="/path", num_speculative_tokens=3
    )
    # what the JSON does not name keeps stallfree's defaults
    assert (cfg.adaptive, cfg.min_acceptance_rate) == (True, 0.1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # no method but a model: a draft model, as in vLLM
        ('{"model": "/d", "num_speculative_tokens": 2}', ("draft_model", "/d", 2)),
        # vLLM's old spelling of ngram, and its GPU build of the same lookup
        ('{"model": "[ngram]"}', ("ngram", None, 4)),
        ('{"method": "[ngram]"}', ("ngram", None, 4)),
        ('{"method": "ngram_gpu", "num_speculative_tokens": 5}', ("ngram", None, 5)),
    ],
)
def test_vllm_method_spellings(text: str, expected: tuple) -> None:
    cfg = spec("serve", "--speculative-config", text)
    assert (cfg.method, cfg.draft_model, cfg.num_speculative_tokens) == expected


@pytest.mark.parametrize(
    ("keys", "bounds"),
    [
        ({"prompt_lookup_max": 3}, (3, 3)),  # one bound alone sets the other, as vLLM does
        ({"prompt_lookup_min": 6}, (6, 6)),
        ({}, (1, 4)),  # neither: stallfree's defaults
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 7}, (2, 7)),
    ],
)
def test_vllm_lookup_bounds(keys: dict, bounds: tuple[int, int]) -> None:
    cfg = spec("serve", "--speculative-config", json.dumps({"method": "ngram", **keys}))
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == bounds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "'draft_tensor_parallel_size'"),
        ('{"method": "ngram", "disable_by_batch_size": 4}', "'disable_by_batch_size'"),
        ('{"num_speculative_tokens": 3}', 'give "method"'),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "less than or equal to 16"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "greater than or equal to 1"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens true"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "valid integer"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "must not exceed"),
        ('{"method": "ngram", "model": "/d"}', "method ngram uses none"),
        ('{"method": "draft_model", "model": "/d", "prompt_lookup_max": 2}', "ngram only"),
        ('{"method": 3}', "must be a string"),
        ('{"method": "lookahead"}', "'lookahead' is not supported"),
    ],
)
def test_bad_vllm_configs_are_usage_errors(text: str, message: str, capsys) -> None:
    argv = ["serve", "--speculative-config", text]
    if "must not exceed" in message:  # the section's own check, after parsing
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "invalid configuration" in err and message in err
        return
    line = usage_error(argv, capsys)
    assert "argument --speculative-config:" in line and message in line


@pytest.mark.parametrize(
    "method", ["eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix", "deepseek_mtp"]
)
def test_vllm_methods_not_built_are_refused(method: str, capsys) -> None:
    text = json.dumps({"method": method, "model": "/d", "num_speculative_tokens": 3})
    line = usage_error(["serve", "--speculative-config", text], capsys)
    assert f"method {method!r} is not supported" in line and "ngram" in line


# ---------------------------------------------------------------- SGLang's flags


def test_sglang_ngram_flags() -> None:
    cfg = spec(
        "serve",
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "4",
        "--speculative-ngram-min-match-window-size",
        "2",
        "--speculative-ngram-max-match-window-size",
        "4",
    )
    assert cfg == spec("serve", "--speculative-config", NGRAM_JSON)


def test_sglang_standalone_flags() -> None:
    cfg = spec(
        "serve",
        "--speculative-algorithm",
        "STANDALONE",
        "--speculative-draft-model-path",
        "/path",
        "--speculative-num-draft-tokens",
        "4",  # k + 1 with top-k 1
        "--speculative-eagle-topk",
        "1",
    )
    assert cfg == spec("serve", "--speculative-config", DRAFT_JSON)
    assert cfg.num_speculative_tokens == 3


def test_sglang_algorithm_names_ignore_case() -> None:
    assert spec("serve", "--speculative-algorithm", "ngram").method == "ngram"
    standalone = spec(
        "serve", "--speculative-algorithm", "Standalone", "--speculative-draft-model-path", "/d"
    )
    assert (standalone.method, standalone.draft_model) == ("draft_model", "/d")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-algorithm", "EAGLE"], "EAGLE is not supported"),
        (["--speculative-algorithm", "EAGLE3"], "EAGLE3 is not supported"),
        (["--speculative-algorithm", "NEXTN"], "NEXTN is not supported"),
        (["--speculative-algorithm", "LOOKUP"], "choose from NGRAM, STANDALONE"),
        (["--speculative-eagle-topk", "4"], "only 1 is supported"),
        (["--speculative-eagle-topk", "x"], "not a whole number"),
        (["--speculative-num-draft-tokens", "1"], "at least 2"),
        (["--speculative-num-draft-tokens", "18"], "18 (k = 17)"),
        (["--speculative-num-steps", "0"], "greater than or equal to 1"),
        (["--speculative-num-steps", "17"], "less than or equal to 16"),
        (["--speculative-ngram-max-match-window-size", "65"], "less than or equal to 64"),
        (["--speculative-min-acceptance-rate", "1.5"], "less than or equal to 1"),
        (["--speculative-min-acceptance-rate", "nan"], "finite number"),
    ],
)
def test_bad_sglang_values_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    line = usage_error(["serve", *argv], capsys)
    assert f"argument {argv[0]}:" in line and message in line


# ---------------------------------------------------------------- the spellings together


def test_spellings_that_agree_are_fine() -> None:
    cfg = spec(
        "serve",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "3",
        "--speculative-num-draft-tokens",
        "4",
    )
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 3)


def test_one_flag_given_twice_keeps_the_last() -> None:
    cfg = spec(
        "serve",
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "2",
        "--speculative-num-steps",
        "6",
    )
    assert cfg.num_speculative_tokens == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--speculative-config", '{"method": "ngram"}', "--speculative-algorithm", "STANDALONE"],
            "--speculative-algorithm STANDALONE sets speculative.method to 'draft_model', but "
            "--speculative-config sets it to 'ngram'",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-config", DRAFT_JSON],
            "--speculative-config sets speculative.method to 'draft_model', but "
            "--speculative-algorithm NGRAM sets it to 'ngram'",
        ),
        (
            ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "5"],
            "--speculative-num-draft-tokens 5 sets speculative.num_speculative_tokens to 4, "
            "but --speculative-num-steps 3 sets it to 3",
        ),
        (
            ["--speculative-config", NGRAM_JSON, "--speculative-num-steps", "2"],
            "--speculative-num-steps 2 sets speculative.num_speculative_tokens to 2",
        ),
        (
            ["--speculative-config", DRAFT_JSON, "--speculative-draft-model-path", "/other"],
            "sets speculative.draft_model to '/other', but --speculative-config sets it to "
            "'/path'",
        ),
        (
            ["--speculative-config", NGRAM_JSON,
             "--speculative-ngram-max-match-window-size", "8"],
            "sets speculative.prompt_lookup_max to 8",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "/d"],
            "--speculative-draft-model-path /d names a draft model, but "
            "--speculative-algorithm NGRAM chooses ngram",
        ),
        (
            ["--speculative-draft-model-path", "/d", "--speculative-config", NGRAM_JSON],
            "--speculative-draft-model-path /d names a draft model, but --speculative-config "
            "chooses ngram",
        ),
        (
            ["--speculative-algorithm", "STANDALONE",
             "--speculative-ngram-min-match-window-size", "2"],
            "sets speculative.prompt_lookup_min, which only ngram uses, but "
            "--speculative-algorithm STANDALONE chooses draft_model",
        ),
    ],
)  # fmt: skip
def test_spellings_that_disagree_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    assert message in usage_error(["serve", *argv], capsys)


# ---------------------------------------------------------------- stallfree's own, and the rest


def test_stallfree_own_flags() -> None:
    cfg = spec(
        "serve",
        "--speculative-algorithm",
        "NGRAM",
        "--no-speculative-adaptive",
        "--speculative-min-acceptance-rate",
        "0.25",
    )
    assert (cfg.adaptive, cfg.min_acceptance_rate) == (False, 0.25)
    assert spec("serve", "--speculative-algorithm", "NGRAM", "--speculative-adaptive").adaptive


def test_no_flags_leave_the_section_alone() -> None:
    assert spec("serve") == SpeculativeConfig()
    assert parse("serve").speculative is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculative-num-steps", "3"],
        ["--speculative-eagle-topk", "1"],
        ["--speculative-draft-model-path", "/d"],
        ["--no-speculative-adaptive"],
        ["--speculative-min-acceptance-rate", "0.5"],
    ],
)
def test_flags_that_would_do_nothing_are_refused(argv: list[str], capsys) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stallfree: speculative decoding is off") and argv[0] in err
    assert len(err.splitlines()) == 1


def test_the_method_may_come_from_the_config_file_or_the_environment(tmp_path, monkeypatch) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('[speculative]\nmethod = "ngram"\nprompt_lookup_max = 6\n')
    cfg = spec("serve", "--config", str(toml), "--speculative-num-steps", "2")
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 2, 6)
    monkeypatch.setenv("STALLFREE_SPECULATIVE__METHOD", "ngram")
    assert spec("serve", "--speculative-num-draft-tokens", "3").num_speculative_tokens == 2
    # flags win over the environment
    flagged = spec(
        "serve", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/d"
    )
    assert (flagged.method, flagged.draft_model) == ("draft_model", "/d")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-algorithm", "STANDALONE"], "needs speculative.draft_model"),
    ],
)
def test_the_sections_own_checks_still_apply(argv: list[str], message: str, capsys) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_speculation_with_worker_processes_is_a_configuration() -> None:
    """Once refused ("does not compose with worker processes yet"): each rank now runs the
    proposer and the verify step (tests/parallel/test_speculative_workers.py)."""
    for extra in (["--tp-size", "2"], ["--worker", "process"]):
        cfg = config_from_args(parse("serve", "--speculative-algorithm", "NGRAM", *extra))
        assert cfg.speculative.method == "ngram" and cfg.uses_worker_processes


# ---------------------------------------------------------------- every command


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_both_spellings(command: list[str]) -> None:
    vllm = spec(*command, "--speculative-config", NGRAM_JSON)
    sglang = spec(
        *command,
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "5",
        "--speculative-ngram-min-match-window-size",
        "2",
        "--speculative-ngram-max-match-window-size",
        "4",
    )
    assert (
        vllm
        == sglang
        == SpeculativeConfig(
            method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4
        )
    )
    draft = spec(*command, "--speculative-config", DRAFT_JSON, "--no-speculative-adaptive")
    assert (draft.method, draft.draft_model, draft.adaptive) == ("draft_model", "/path", False)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_a_conflict_with_its_own_usage(command: list[str], capsys) -> None:
    argv = [*command, "--speculative-config", NGRAM_JSON, "--speculative-algorithm", "STANDALONE"]
    assert "sets speculative.method" in usage_error(argv, capsys)


def test_bench_passes_the_flags_through_its_checks_and_records_them() -> None:
    from stallfree.bench.flag_checks import check_flags

    args = parse("bench", "--speculative-config", DRAFT_JSON, "--speculative-num-steps", "3")
    check_flags(args)
    assert config_from_args(args).speculative.draft_model == "/path"
    # bench writes its arguments into --output-json
    recorded = json.loads(json.dumps(vars(args)))["speculative"]
    assert recorded["--speculative-num-steps"] == {
        "value": "3",
        "sets": {"num_speculative_tokens": 3},
    }


@pytest.mark.parametrize(
    "flags",
    [["--speculative-config", NGRAM_JSON], ["--no-speculative-adaptive"]],
    ids=["vllm", "own"],
)
def test_bench_refuses_speculative_flags_for_a_server_it_does_not_start(flags) -> None:
    from stallfree.bench.flag_checks import UsageError, check_flags

    args = parse("bench", "--base-url", "http://127.0.0.1:8000", *flags)
    with pytest.raises(UsageError, match="engine this command starts"):
        check_flags(args)


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_help_names_each_default_and_setting(command: str) -> None:
    parser = subparsers(build_parser()).choices[command]
    fmt = HelpFormatter(parser.prog)
    texts = {
        a.option_strings[0]: fmt._get_help_string(a) or ""
        for a in parser._actions
        if a.option_strings and a.option_strings[0].startswith("--speculative")
    }
    defaults = SpeculativeConfig()
    assert len(texts) == 10
    assert "(default: none, speculative decoding off;" in texts["--speculative-config"]
    assert "(default: none; sets speculative.method)" in texts["--speculative-algorithm"]
    k = defaults.num_speculative_tokens
    assert (
        f"(default: {k}; sets speculative.num_speculative_tokens)"
        in texts["--speculative-num-steps"]
    )
    assert f"(default: {k + 1}; sets" in texts["--speculative-num-draft-tokens"]
    assert "(default: 1)" in texts["--speculative-eagle-topk"]
    assert (
        "(default: none; sets speculative.draft_model)" in texts["--speculative-draft-model-path"]
    )
    assert (
        f"(default: {defaults.prompt_lookup_min}; sets speculative.prompt_lookup_min)"
        in (texts["--speculative-ngram-min-match-window-size"])
    )
    assert (
        f"(default: {defaults.prompt_lookup_max}; sets speculative.prompt_lookup_max)"
        in (texts["--speculative-ngram-max-match-window-size"])
    )
    assert "(default: on; sets speculative.adaptive)" in texts["--speculative-adaptive"]
    assert (
        f"(default: {defaults.min_acceptance_rate}; sets"
        in (texts["--speculative-min-acceptance-rate"])
    )
