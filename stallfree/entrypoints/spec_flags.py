"""Speculative decoding's rows of the flag table, in vLLM's spelling (`--speculative-config
JSON`) and SGLang's (`--speculative-algorithm`, `--speculative-num-steps`, ...), all filling the
one `speculative` section through `SectionFlag`. Each flag's values are checked as it is
parsed; two flags that set one setting to different values are refused there, as a usage
error, rather than one of them silently winning.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from stallfree.config import SpeculativeConfig, StallfreeConfig
from stallfree.entrypoints.flags import SWITCH, Flag, SectionFlag, Table, config_default, flag

# the namespace attribute that collects what the flags below say: {flag: {"value", "sets"}}
SPEC_DEST = "speculative"

# vLLM's method names that stallfree runs, and as what; ngram_gpu is vLLM's GPU build of the
# same prompt lookup, so it proposes the same drafts here
_VLLM_METHODS = {
    "ngram": "ngram",
    "[ngram]": "ngram",
    "ngram_gpu": "ngram",
    "draft_model": "draft_model",
}
# the keys of vLLM's speculative config that mean a setting here (model: draft_model)
_VLLM_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
_BOUNDS = {"prompt_lookup_min", "prompt_lookup_max"}
_SGLANG_ALGORITHMS = {"NGRAM": "ngram", "STANDALONE": "draft_model"}
_SGLANG_UNSUPPORTED = ("EAGLE", "EAGLE3", "NEXTN")
_NOT_BUILT = (
    "stallfree speculates with ngram (prompt lookup) or a draft model only; EAGLE-style, MTP, "
    "Medusa and suffix-decoding drafters are not built"
)


def _checked(key: str, value: Any, shown: str) -> Any:
    """`value` as the setting `speculative.key` takes it, or ArgumentTypeError saying why not
    (with `value` written as `shown`)."""
    field = SpeculativeConfig.model_fields[key]
    try:
        return TypeAdapter(Annotated[field.annotation, field]).validate_python(value, strict=True)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        raise argparse.ArgumentTypeError(
            f"{shown} is not a valid speculative.{key}: {reason}"
        ) from None


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _setting(key: str, convert: Callable[[str], Any] = _whole) -> Callable[[str], Any]:
    """An argparse type: the text converted, then checked as `speculative.key`."""
    return lambda text: _checked(key, convert(text), text)


def _sets(key: str, convert: Callable[[str], Any] = _whole) -> Callable[[str], dict[str, Any]]:
    """A flag's text as the one setting `speculative.key` it fills."""
    check = _setting(key, convert)
    return lambda text: {key: check(text)}


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _vllm_method(method: Any) -> str:
    if not isinstance(method, str):
        raise argparse.ArgumentTypeError(f"method must be a string, not {method!r}")
    if method in _VLLM_METHODS:
        return _VLLM_METHODS[method]
    raise argparse.ArgumentTypeError(f"method {method!r} is not supported: {_NOT_BUILT}")


def vllm_speculative_config(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON as settings of `speculative`: `model` is the draft
    model's path; an omitted `method` is draft_model when `model` names one (as in vLLM), and
    ngram for vLLM's old `"model": "[ngram]"`. With ngram, a lookup bound given alone sets the
    other one too, as vLLM does; neither given leaves stallfree's defaults."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    unknown = [key for key in raw if key not in _VLLM_KEYS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"key {unknown[0]!r} is not supported (stallfree takes {', '.join(_VLLM_KEYS)})"
        )
    model = raw.get("model")
    if model in ("ngram", "[ngram]"):
        model = None
        raw.setdefault("method", "ngram")
    if "method" not in raw:
        if model is None:
            raise argparse.ArgumentTypeError(
                'give "method" ("ngram" or "draft_model"), or "model" for a draft model'
            )
        raw["method"] = "draft_model"
    settings: dict[str, Any] = {"method": _vllm_method(raw["method"])}
    if model is not None:
        settings["draft_model"] = _checked("draft_model", model, f"model {json.dumps(model)}")
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if key in raw:
            settings[key] = _checked(key, raw[key], f"{key} {json.dumps(raw[key])}")
    _check_json_keys(settings)
    if settings["method"] == "ngram":
        low, high = settings.get("prompt_lookup_min"), settings.get("prompt_lookup_max")
        if low is None and high is not None:
            settings["prompt_lookup_min"] = high
        elif high is None and low is not None:
            settings["prompt_lookup_max"] = low
    return settings


def _check_json_keys(settings: dict[str, Any]) -> None:
    """Refuse a draft model with ngram, and lookup bounds with a draft model, in one JSON."""
    if settings["method"] == "ngram" and "draft_model" in settings:
        raise argparse.ArgumentTypeError('"model" names a draft model, but method ngram uses none')
    if settings["method"] == "draft_model" and _BOUNDS & settings.keys():
        raise argparse.ArgumentTypeError(
            "prompt_lookup_min and prompt_lookup_max apply to method ngram only, not draft_model"
        )


def _sglang_algorithm(text: str) -> str:
    name = text.upper()
    if name in _SGLANG_ALGORITHMS:
        return _SGLANG_ALGORITHMS[name]
    if name in _SGLANG_UNSUPPORTED:
        raise argparse.ArgumentTypeError(f"{text} is not supported: {_NOT_BUILT}")
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(_SGLANG_ALGORITHMS)})"
    )


def _draft_tokens(text: str) -> int:
    """SGLang's draft token count with top-k 1: the last verified token and k drafts."""
    count = _whole(text)
    if count < 2:
        raise argparse.ArgumentTypeError(
            f"{count} draft tokens leave no token to speculate: SGLang counts the last verified "
            "token too, so N is k + 1 (at least 2)"
        )
    _checked("num_speculative_tokens", count - 1, f"{count} (k = {count - 1})")
    return count


def _eagle_topk(text: str) -> dict[str, Any]:
    """SGLang's drafts per step: 1 is what stallfree does, so it sets nothing."""
    topk = _whole(text)
    if topk != 1:
        raise argparse.ArgumentTypeError(
            f"only 1 is supported (got {topk}): stallfree drafts one chain of tokens, not a tree"
        )
    return {}


def _label(flag: str, value: str) -> str:
    return flag if flag == "--speculative-config" else f"{flag} {value}"


def merged_settings(given: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The settings of every speculative flag given, or ValueError where two disagree."""
    settings: dict[str, Any] = {}
    source: dict[str, str] = {}
    for flag_name, entry in given.items():
        label = _label(flag_name, entry["value"])
        for key, value in entry["sets"].items():
            if key in settings and settings[key] != value:
                raise ValueError(
                    f"{label} sets speculative.{key} to {value!r}, but {source[key]} sets it to "
                    f"{settings[key]!r}; give one of them, or make them agree"
                )
            settings[key] = value
            source.setdefault(key, label)
    method = settings.get("method")
    if method == "ngram" and "draft_model" in settings:
        raise ValueError(
            f"{source['draft_model']} names a draft model, but {source['method']} chooses "
            "ngram, which uses none"
        )
    bounds = sorted(_BOUNDS & settings.keys())
    if method == "draft_model" and bounds:
        raise ValueError(
            f"{source[bounds[0]]} sets speculative.{bounds[0]}, which only ngram uses, but "
            f"{source['method']} chooses draft_model"
        )
    return settings


def _check(given: dict[str, Any], flag_name: str, entry: dict[str, Any]) -> None:
    """The flag given again: its last value counts, and the order is the command line's."""
    given = {k: v for k, v in given.items() if k != flag_name}
    merged_settings({**given, flag_name: entry})


def _spec(name: str, to: Callable[[str], dict[str, Any]], **kw: Any) -> Flag:
    """A row of the section: `to` turns the flag's text into the settings it fills."""
    return flag(name, action=SectionFlag, dest=SPEC_DEST, check=_check, to=to, **kw)


_K = config_default("speculative", "num_speculative_tokens")
# fmt: off
# vLLM's and SGLang's spellings, and stallfree's own for the settings neither has
SPECULATIVE_FLAGS: Table = (("speculative decoding", [
    _spec("--speculative-config", vllm_speculative_config, metavar="JSON",
          help="vLLM's spelling: a JSON object with method (ngram or draft_model; ngram_gpu "
          "means ngram), num_speculative_tokens, prompt_lookup_min and prompt_lookup_max "
          "(ngram; one given alone sets the other too, as in vLLM), and model (the draft "
          "model's path; an omitted method is then draft_model); other keys are refused "
          "(default: none, speculative decoding off; sets speculative.*)"),
    _spec("--speculative-algorithm", lambda text: {"method": _sglang_algorithm(text)},
          metavar="{NGRAM,STANDALONE}", sets="speculative.method",
          help="SGLang's spelling: NGRAM (prompt lookup) or STANDALONE (a draft model, "
          "--speculative-draft-model-path); EAGLE, EAGLE3 and NEXTN are not supported"),
    _spec("--speculative-num-steps", _sets("num_speculative_tokens"), metavar="N",
          sets="speculative.num_speculative_tokens",
          help="SGLang's spelling: k, the draft tokens proposed per request and step"),
    _spec("--speculative-num-draft-tokens",
          lambda text: {"num_speculative_tokens": _draft_tokens(text) - 1}, metavar="N",
          help="SGLang's spelling: the tokens verified per request and step, the last verified "
          "one included, so k + 1 (top-k 1); it must agree with --speculative-num-steps "
          f"(default: {_K + 1}; sets speculative.num_speculative_tokens to N - 1)"),
    _spec("--speculative-eagle-topk", _eagle_topk, metavar="1",
          help="SGLang's spelling: drafts per step; only 1 (a chain, no tree) is supported "
          "(default: 1)"),
    _spec("--speculative-draft-model-path", _sets("draft_model", str), metavar="PATH",
          sets="speculative.draft_model", unset="none",
          help="SGLang's spelling: the draft model of STANDALONE (a Hugging Face directory "
          "or a .gguf file with the target's tokenizer)"),
    *(_spec(f"--speculative-ngram-{bound}-match-window-size", _sets(key), metavar="TOKENS",
            sets=f"speculative.{key}",
            help=f"SGLang's spelling: NGRAM's {which} suffix of the tokens that is looked up")
      for bound, which, key in (("min", "shortest", "prompt_lookup_min"),
                                ("max", "longest", "prompt_lookup_max"))),
    flag("--speculative-adaptive", dest="speculative_adaptive", **SWITCH,
         sets="speculative.adaptive",
         help="per request, stop proposing while its drafts are mostly rejected, and "
         "resume once its text repeats again"),
    flag("--speculative-min-acceptance-rate", dest="speculative_min_acceptance_rate",
         type=_setting("min_acceptance_rate", _rate), metavar="RATE",
         sets="speculative.min_acceptance_rate",
         help="adaptive: a request whose recent drafts are accepted below this rate "
         "stops proposing"),
]),)
# fmt: on


def speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What vLLM's and SGLang's speculative flags set, merged (the parser checked that they
    agree)."""
    return merged_settings(getattr(args, SPEC_DEST, None) or {})


def check_speculative_flags(args: argparse.Namespace, config: StallfreeConfig) -> None:
    """Refuse speculative flags that would do nothing: speculative decoding is off."""
    given = [*(getattr(args, SPEC_DEST, None) or {})]
    adaptive = getattr(args, "speculative_adaptive", None)
    if adaptive is not None:
        given.append("--speculative-adaptive" if adaptive else "--no-speculative-adaptive")
    if getattr(args, "speculative_min_acceptance_rate", None) is not None:
        given.append("--speculative-min-acceptance-rate")
    if given and not config.speculative.enabled:
        raise ValueError(
            f"speculative decoding is off (speculative.method is none), so {', '.join(given)} "
            "would do nothing; turn it on with --speculative-config or --speculative-algorithm"
        )
