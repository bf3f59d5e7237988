"""baton's tokenizer against the Hugging Face tokenizer that transformers builds from the same GGUF file.

Binaries come from $BATON_BUILD_DIR (default: <repo>/build), the model from $BATON_MODEL or the cache.
Besides the default model (byte-level BPE, 'smollm' pre-tokenizer) it checks the other pre-tokenizers by
rewriting the default model's vocabulary with tokenizer.ggml.pre = llama-bpe / qwen2 / gpt2 / gpt-4o / tekken,
and the SentencePiece ('llama') model on a small vocabulary trained here with the sentencepiece package.
Pinned oracle versions: transformers 5.24, tokenizers 0.23, gguf 0.19, sentencepiece (any recent).
"""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "data"))

import hf_tokenizer_oracle as oracle  # noqa: E402
import tokenizer_corpus  # noqa: E402

from conftest import build_dir, default_model_path  # noqa: E402

BATON = build_dir() / "bin" / "baton"
MODEL = default_model_path()


def baton(*args, input_text=None, check=True):
    r = subprocess.run([str(BATON), *map(str, args)], input=input_text, capture_output=True, text=True,
                       encoding="utf-8", timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"baton {' '.join(map(str, args))} exited {r.returncode}: {r.stderr}")
    return r


def baton_encode(model, texts, *flags):
    r = baton("tokenize", "--model", model, "--jsonl", *flags, input_text="".join(json.dumps(s) + "\n" for s in texts))
    lines = r.stdout.split("\n")[:-1]
    assert len(lines) == len(texts)
    return [json.loads(line) for line in lines]


def baton_decode(model, id_lists, *flags):
    r = baton("tokenize", "--model", model, "--decode", "--jsonl", *flags,
              input_text="".join(json.dumps(ids) + "\n" for ids in id_lists))
    lines = r.stdout.split("\n")[:-1]
    assert len(lines) == len(id_lists)
    return [json.loads(line) for line in lines]


def compare(model, texts, add_special=False, hf=None):
    if hf is None:
        hf, _ = oracle.build(str(model))
    want = [hf.encode(s, add_special_tokens=add_special) for s in texts]
    got = baton_encode(model, texts, *(["--add-special"] if add_special else []))
    bad = [(s, w, g) for s, w, g in zip(texts, want, got) if w != g]
    detail = "\n".join(f"  {s!r}\n    hf    {w}\n    baton {g}" for s, w, g in bad[:5])
    assert not bad, f"{len(bad)} of {len(texts)} strings differ from the HF tokenizer:\n{detail}"
    return got


@pytest.fixture(scope="module")
def corpus():
    texts = tokenizer_corpus.corpus(2400)
    assert len(texts) >= 2000
    return texts


def unspellable(vocab, texts):
    """Indexes of texts holding a byte that the byte-level vocabulary cannot spell: the oracle drops such bytes
    (its BPE has no unknown token) and so does baton, so those texts cannot round-trip."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = set(vocab)
    missing = {b for b, ch in bytes_to_unicode().items() if ch not in vocab}
    return {i for i, s in enumerate(texts) if missing & set(s.encode("utf-8"))}


def check_roundtrip(model, texts, ids):
    skip = unspellable(oracle.build(str(model))[1]["tokenizer.ggml.tokens"], texts)
    assert len(skip) < len(texts) // 20
    back = baton_decode(model, ids)
    bad = [(s, b) for i, (s, b) in enumerate(zip(texts, back)) if s != b and i not in skip]
    assert not bad, f"{len(bad)} strings do not round-trip: {bad[:3]!r}"


def test_default_model_matches_hf(corpus):
    got = compare(MODEL, corpus)
    check_roundtrip(MODEL, corpus, got)


def test_add_special_matches_hf(corpus):
    compare(MODEL, corpus[:200], add_special=True)


def test_no_parse_special_keeps_text():
    ids = baton_encode(MODEL, ["<|im_start|>user"], "--no-parse-special")[0]
    assert 1 not in ids
    assert baton_decode(MODEL, [ids])[0] == "<|im_start|>user"


def test_skip_special_decode():
    assert baton_decode(MODEL, [[1, 4093, 2]], "--skip-special")[0] == "user"


def test_cli_text_and_decode():
    r = baton("tokenize", "--model", MODEL, "Hello world")
    ids = [int(x) for x in r.stdout.split()]
    hf, _ = oracle.build(str(MODEL))
    assert ids == hf.encode("Hello world", add_special_tokens=False)
    r = baton("tokenize", "--model", MODEL, "--decode", " ".join(map(str, ids)))
    assert r.stdout == "Hello world\n"


def test_cli_errors_are_one_line():
    r = baton("tokenize", "--model", MODEL, "--decode", "1 x 2", check=False)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    r = baton("tokenize", "--model", MODEL, "--decode", "99999999", check=False)
    assert r.returncode == 1 and "outside the vocabulary" in r.stderr
    r = baton("tokenize", "--model", MODEL, "--jsonl", input_text="not json\n", check=False)
    assert r.returncode == 1 and "line 1" in r.stderr
    r = baton("tokenize", "--model", "/nonexistent.gguf", "x", check=False)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    r = baton("tokenize", "--bogus", check=False)
    assert r.returncode == 2


def child_cpu_s():
    """CPU seconds (user + system) used so far by this process's finished children: a speed bound on it holds on
    a loaded machine, where wall time does not."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def test_long_prompt_is_fast(tmp_path):
    rng_text = "".join(tokenizer_corpus.corpus(400)[100:])
    text = (rng_text * (100_000 // len(rng_text) + 1))[:100_000]
    # cut at a character boundary
    text = text.encode("utf-8")[:100_000].decode("utf-8", "ignore")
    p = tmp_path / "long.txt"
    p.write_text(text, encoding="utf-8")
    t0 = child_cpu_s()
    r = baton("tokenize", "--model", MODEL, "--file", p, "--time")
    cpu = child_cpu_s() - t0
    assert cpu < 1.0, f"100 KB took {cpu:.2f} s of CPU, model load included ({r.stderr.strip()})"
    hf, _ = oracle.build(str(MODEL))
    assert [int(x) for x in r.stdout.split()] == hf.encode(text, add_special_tokens=False)
    # pathological single pieces: one 100 KB word and 100 KB of spaces
    for s in ["a" * 100_000, " " * 100_000, "😀" * 25_000]:
        t0 = child_cpu_s()
        got = baton_encode(MODEL, [s])[0]
        assert child_cpu_s() - t0 < 1.0, f"{s[:3]!r}... took {child_cpu_s() - t0:.2f} s of CPU"
        assert got == hf.encode(s, add_special_tokens=False)


# ---- other pre-tokenizers: the default model's vocabulary under another tokenizer.ggml.pre ----

def write_gguf(path, md, overrides):
    import gguf
    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    for key, val in {**{k: v for k, v in md.items() if k.startswith("tokenizer.")}, **overrides}.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(x) for x in val])
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(x) for x in val])
        else:
            w.add_array(key, list(val))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2", "gpt-4o", "tekken"])
def test_other_pre_tokenizers_match_hf(tmp_path, corpus, pre):
    _, md = oracle.build(str(MODEL))
    path = tmp_path / f"{pre}.gguf"
    md = {**md, "tokenizer.ggml.pre": pre}
    write_gguf(path, md, {})
    got = compare(path, corpus[:1200], hf=oracle.build_from_metadata(md))
    skip = unspellable(md["tokenizer.ggml.tokens"], corpus[:1200])
    back = baton_decode(path, got)
    assert not [s for i, (s, b) in enumerate(zip(corpus[:1200], back)) if s != b and i not in skip]


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    _, md = oracle.build(str(MODEL))
    path = tmp_path / "odd.gguf"
    write_gguf(path, {**md, "tokenizer.ggml.pre": "no-such-pre"}, {})
    r = baton("tokenize", "--model", path, "x", check=False)
    assert r.returncode == 1 and "no-such-pre" in r.stderr


# ---- SentencePiece ('llama' tokenizer model) ----

def train_spm(tmp_path, corpus):
    import sentencepiece as spm  # pinned in tests/requirements.txt
    text = tmp_path / "train.txt"
    text.write_text("\n".join(s.replace("\n", " ") for s in corpus[:1500] if s.strip()), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "spm"), vocab_size=3000,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.98,
                                   num_threads=1, minloglevel=2, split_digits=True, allow_whitespace_only_pieces=True,
                                   remove_extra_whitespaces=False, normalization_rule_name="identity")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        else:
            types.append(1)
    return tokens, scores, types


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("spm")
    tokens, scores, types = train_spm(tmp, corpus)
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    path = tmp / "spm.gguf"
    write_gguf(path, md, {})
    return path


def test_sentencepiece_matches_hf(spm_model, corpus):
    texts = corpus[:1200]
    got = compare(spm_model, texts)
    compare(spm_model, texts[:300], add_special=True)
    hf, _ = oracle.build(str(spm_model))
    back = baton_decode(spm_model, got)
    want = [hf.decode(ids) for ids in got]
    bad = [(s, b, w) for s, b, w in zip(texts, back, want) if b != s and b != w]
    assert not bad, f"{len(bad)} decodes differ from both the text and HF: {bad[:3]!r}"


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_hf(corpus, skip):
    hf, _ = oracle.build(str(MODEL))
    texts = corpus[:600]
    ids = baton_encode(MODEL, texts, "--add-special")
    got = baton_decode(MODEL, ids, *(["--skip-special"] if skip else []))
    want = [hf.decode(i, skip_special_tokens=skip) for i in ids]
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, f"{len(bad)} decodes differ from HF: {bad[:3]!r}"
