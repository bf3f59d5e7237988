"""The Hugging Face tokenizer that transformers builds from a GGUF file, without torch (the test oracle).

transformers' own GGUF path (AutoTokenizer.from_pretrained(gguf_file=...)) imports torch to read the file;
this reads the same tokenizer.ggml.* keys with gguf-py and then follows transformers' steps:
get_gguf_tokenizer's grouping, convert_gguf_tokenizer for the backend, and the tokenizer class's special tokens.
Tested with transformers 5.24, tokenizers 0.23, gguf 0.19.
"""
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import gguf  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: E402
    GGUF_TOKENIZER_MAPPING,
    _SPECIAL_TOKENS,
    convert_gguf_tokenizer,
)


def read_metadata(path):
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith(("tokenizer.", "general."))}


_CACHE = {}


def build(path):
    """(PreTrainedTokenizerFast, metadata) for the GGUF file at path (cached per path and modification time)."""
    key = (str(path), os.stat(path).st_mtime_ns)
    if key not in _CACHE:
        md = read_metadata(str(path))
        _CACHE[key] = (build_from_metadata(md), md)
    return _CACHE[key]


def build_from_metadata(md):
    """The tokenizer for GGUF metadata already read (a dict of key -> contents())."""
    arch = md["general.architecture"]
    grouped = {
        group: {name: md[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in md}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    td, cfg = grouped["tokenizer"], grouped["tokenizer_config"]
    if td.get("tokenizer_type") == "llama":
        cfg.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        tid = md.get(f"tokenizer.ggml.{key}")
        cfg[name] = td["tokens"][tid] if tid is not None else None
    backend, _ = convert_gguf_tokenizer(arch, td)
    kwargs = {k: v for k, v in cfg.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
