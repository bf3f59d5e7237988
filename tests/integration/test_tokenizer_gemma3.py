"""Gemma 3's tokenizer (SentencePiece 'llama' model, 262,144 tokens, no space prefix, whitespace runs and newlines
as user-defined tokens, <start_of_turn>/<end_of_turn> control tokens) and chat format, on the real file:
- encoding equals the Hugging Face tokenizer transformers builds from the same GGUF (hf_tokenizer_oracle) on
  1,500 strings of the shared corpus, and decoding gives the text back;
- every token decodes to its gguf-py vocabulary entry (U+2581 as a space, <0xXX> as its byte);
- the file has no tokenizer.chat_template: baton renders Gemma's turn format (the built-in gemma renderer),
  byte-identical to Jinja2 rendering the Gemma template through the HF tokenizer's apply_chat_template, and its
  turn markers become the control tokens.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "data"))

import hf_tokenizer_oracle as oracle  # noqa: E402
import tokenizer_corpus  # noqa: E402
from test_chat_template_hf import GEMMA  # noqa: E402

START, END = 105, 106  # <start_of_turn>, <end_of_turn>


def run(baton_bin, *args, input_text=None):
    r = subprocess.run([str(baton_bin), *map(str, args)], input=input_text, capture_output=True, text=True,
                       encoding="utf-8", timeout=300)
    assert r.returncode == 0, f"baton {args[0]}: {r.stderr}"
    return r.stdout


def encode(baton_bin, model, texts, *flags):
    out = run(baton_bin, "tokenize", "--model", model, "--jsonl", *flags,
              input_text="".join(json.dumps(s) + "\n" for s in texts))
    return [json.loads(line) for line in out.split("\n")[:-1]]


def decode(baton_bin, model, id_lists):
    out = run(baton_bin, "tokenize", "--model", model, "--decode", "--jsonl",
              input_text="".join(json.dumps(ids) + "\n" for ids in id_lists))
    return [json.loads(line) for line in out.split("\n")[:-1]]


@pytest.fixture(scope="module")
def hf(gemma3_model):
    return oracle.build(str(gemma3_model))


def test_gemma3_encoding_matches_hf(baton_bin, gemma3_model, hf):
    """Strings holding a run of more than 31 spaces are left out: the vocabulary's whitespace tokens (user-defined,
    1..31 spaces) tile such a run in several ways; baton takes the longest first (as llama.cpp's special-token
    partition does), the converted HF tokenizer another tiling (100 spaces: baton 31+31+31+7, HF 16*5+20)."""
    tok, _ = hf
    texts = [s for s in tokenizer_corpus.corpus(2400)[:1500] if not re.search(" {32}", s)]
    assert len(texts) >= 1450
    want = [tok.encode(s, add_special_tokens=False) for s in texts]
    got = encode(baton_bin, gemma3_model, texts)
    bad = [(s, w, g) for s, w, g in zip(texts, want, got) if w != g]
    detail = "\n".join(f"  {s!r:.80}\n    hf    {w[:20]}\n    baton {g[:20]}" for s, w, g in bad[:5])
    assert not bad, f"{len(bad)} of {len(texts)} strings differ from the HF tokenizer:\n{detail}"
    back = decode(baton_bin, gemma3_model, got)
    bad = [(s, b) for s, b in zip(texts, back) if s != b]
    assert not bad, f"{len(bad)} strings do not round-trip: {bad[:3]!r}"
    # BOS added (add_bos_token), no space prefix (add_space_prefix = false): "Hello" is 'Hello', not '▁Hello'
    assert encode(baton_bin, gemma3_model, ["Hello world"], "--add-special")[0] == \
        tok.encode("Hello world", add_special_tokens=True)
    assert tok.encode("Hello world", add_special_tokens=True)[0] == 2


def test_gemma3_tokens_decode_to_vocabulary(baton_bin, gemma3_model, hf):
    _, md = hf
    vocab = md["tokenizer.ggml.tokens"]
    types = md["tokenizer.ggml.token_type"]
    ids = [i for i in range(0, len(vocab), 97) if types[i] in (1, 4)] + list(range(236000, 236200))
    got = decode(baton_bin, gemma3_model, [[i] for i in ids])
    for i, g in zip(ids, got):
        text = vocab[i]
        m = re.fullmatch(r"<0x([0-9A-F]{2})>", text)
        if m:
            continue  # a byte token alone may be an incomplete UTF-8 sequence
        assert g == text.replace("\u2581", " "), (i, text, g)
    assert len(ids) > 2500


def test_gemma3_chat_format(baton_bin, gemma3_model, hf):
    tok, _ = hf
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "  Hi  "}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke.\nA short one."}],
        [{"role": "user", "content": "日本の首都は？"}],
    ]
    for conv in convs:
        got = run(baton_bin, "chat-template", "--model", gemma3_model, json.dumps(conv))
        want = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, chat_template=GEMMA)
        assert got == want, conv
        ids = encode(baton_bin, gemma3_model, [got])[0]
        assert ids[0] == 2 and ids.count(START) == len(conv) + 1 and ids.count(END) == len(conv), ids
        assert ids == tok.encode(got, add_special_tokens=False)
        # --tokenize: the template's own <bos> only (no second one from add_bos_token), as HF tokenizes it
        tokd = [int(t) for t in run(baton_bin, "chat-template", "--model", gemma3_model, "--tokenize",
                                    json.dumps(conv)).split()]
        assert tokd == ids and tokd[1] != 2
        assert tokd == tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, chat_template=GEMMA,
                                               return_dict=False)
    # a system message goes into the first user turn (Gemma has no system role)
    got = run(baton_bin, "chat-template", "--model", gemma3_model,
              json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))
    assert got == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
