"""baton's forward pass against an independent numpy llama forward pass over weights dequantized by gguf-py.

Teacher forcing on real prompts (English, code, Chinese, ...): every position's logits from `baton logits` are
compared with the oracle's. baton quantizes activations to 16 bits per 32-element block before each matmul (8 with
BATON_ACT_BITS=8) and stores K/V in f16; the oracle computes in float64. Stated bounds over >= 1,000 positions, the
README's figures: 16-bit activations agree on the top-1 token at every position (measured with the scalar, AVX2 and
AVX-512 kernels) with a max relative logit error (max |baton - oracle| / max |oracle| per position) below 1%
(0.24-0.35% measured); 8-bit activations agree at >= 96% of positions (96.5% AVX2, 97.0% AVX-512, 97.1% scalar) with
a max relative error below 30% (11-23% measured).
"""
import json
import os
import subprocess

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPTS = [
    "The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor in 27 BC "
    "and, in the West, ended in 476 AD when Romulus Augustulus was deposed. During this long period the empire grew "
    "to control the entire Mediterranean basin, building roads, aqueducts and cities that still stand today. Latin, "
    "the language of Rome, became the basis of the Romance languages, and Roman law shaped legal systems across "
    "Europe. Historians still debate the causes of the decline of the Western Empire: economic troubles, military "
    "defeats, political instability and the pressure of migrating peoples all played a part.",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[len(items) // 2]\n"
    "    left = [x for x in items if x < pivot]\n    middle = [x for x in items if x == pivot]\n"
    "    right = [x for x in items if x > pivot]\n    return quicksort(left) + middle + quicksort(right)\n\n\n"
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
    "        self._items.append(item)\n\n    def pop(self):\n        if not self._items:\n"
    "            raise IndexError('pop from empty stack')\n        return self._items.pop()\n",
    "北京是中华人民共和国的首都，也是全国的政治、文化和国际交往中心。这座城市有着三千多年的建城史和八百多年的建都史，"
    "拥有故宫、天坛、颐和园和长城等众多名胜古迹。每年都有大量的游客来到这里参观游览，品尝北京烤鸭等地方美食。",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain in three sentences why the sky is blue, and then give one everyday example of the "
    "same effect.<|im_end|>\n<|im_start|>assistant\nThe sky looks blue because sunlight is scattered by the molecules "
    "of the air, and shorter blue wavelengths scatter much more strongly than longer red ones. When we look at any "
    "part of the sky away from the sun, we see this scattered blue light coming toward us from every direction.",
    "Table of results, 2019-2024: revenue 1,204.5; 1,387.2; 1,512.9; 1,498.0; 1,733.6; 1,902.4 (million EUR). "
    "Operating margin: 12.1%, 13.4%, 14.0%, 11.8%, 15.2%, 16.0%. Headcount grew from 4,210 to 5,935 employees, "
    "an increase of 41%. The board proposes a dividend of 0.85 EUR per share for 2024, payable on 14 May 2025.",
    "#include <stdio.h>\n\nstatic int gcd(int a, int b)\n{\n    while (b != 0) {\n        int t = a % b;\n"
    "        a = b;\n        b = t;\n    }\n    return a;\n}\n\nint main(int argc, char **argv)\n{\n"
    "    for (int i = 1; i + 1 < argc; i += 2)\n        printf(\"gcd(%s, %s) = %d\\n\", argv[i], argv[i + 1],\n"
    "               gcd(atoi(argv[i]), atoi(argv[i + 1])));\n    return 0;\n}\n",
    "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。江戸時代には徳川幕府が置かれ、明治維新の後に"
    "首都となりました。現在では政治、経済、文化の中心として、多くの企業や大学、美術館が集まっています。"
    "서울은 대한민국의 수도이며 한강을 중심으로 발전한 도시입니다.",
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, water is split, "
    "oxygen is released, and ATP and NADPH are produced; in the Calvin cycle, carbon dioxide is fixed into sugars.",
]


def deq(t):
    """Dequantized float64 weights shaped [rows][row_len] (numpy order: reversed GGUF dims)."""
    a = dequantize(t.data, t.tensor_type)
    return np.asarray(a, dtype=np.float64).reshape(tuple(int(d) for d in reversed(t.shape)))


class Oracle:
    def __init__(self, path):
        r = GGUFReader(str(path))
        f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.")}
        self.n_layer = f["llama.block_count"]
        self.n_head = f["llama.attention.head_count"]
        self.n_kv = f["llama.attention.head_count_kv"]
        self.n_embd = f["llama.embedding_length"]
        self.hd = self.n_embd // self.n_head
        self.base = f["llama.rope.freq_base"]
        self.eps = f["llama.attention.layer_norm_rms_epsilon"]
        self.w = {t.name: deq(t) for t in r.tensors}

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, n_heads):
        # llama GGUF files rotate adjacent pairs (x[2i], x[2i+1]) of each head
        T = x.shape[0]
        x = x.reshape(T, n_heads, self.hd // 2, 2)
        inv = self.base ** (-np.arange(0, self.hd, 2) / self.hd)
        ang = np.arange(T)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0], x[..., 1]
        out = np.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
        return out.reshape(T, n_heads * self.hd)

    def logits(self, ids):
        w = self.w
        out = w["output.weight"] if "output.weight" in w else w["token_embd.weight"]
        return self.hidden(ids) @ out.T

    def hidden(self, ids):
        """The final hidden states (after the output norm) of every position, float64."""
        w = self.w
        T = len(ids)
        x = w["token_embd.weight"][ids]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        group = self.n_head // self.n_kv
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rmsnorm(x, w[p + "attn_norm.weight"])
            q = self.rope(h @ w[p + "attn_q.weight"].T, self.n_head).reshape(T, self.n_head, self.hd)
            k = self.rope(h @ w[p + "attn_k.weight"].T, self.n_kv).reshape(T, self.n_kv, self.hd)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, self.hd)
            att = np.empty((T, self.n_head, self.hd))
            for hh in range(self.n_head):
                s = q[:, hh, :] @ k[:, hh // group, :].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, hh, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, hh // group, :]
            x = x + att.reshape(T, -1) @ w[p + "attn_output.weight"].T
            h = self.rmsnorm(x, w[p + "ffn_norm.weight"])
            g = h @ w[p + "ffn_gate.weight"].T
            u = h @ w[p + "ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
        return self.rmsnorm(x, w["output_norm.weight"])


def tokenize(baton_bin, model, text):
    res = subprocess.run([str(baton_bin), "tokenize", "--model", str(model), text], capture_output=True, text=True,
                         timeout=60, check=True)
    return [int(t) for t in res.stdout.split()]


def baton_logits(baton_bin, model, ids, tmp_path, chunk, act_bits=None, kv_dtype=None):
    out = tmp_path / "logits.f32"
    env = dict(os.environ, BATON_ACT_BITS=str(act_bits)) if act_bits else None
    kv = ["--kv-dtype", kv_dtype] if kv_dtype else []
    subprocess.run([str(baton_bin), "logits", "--model", str(model), "--chunk", str(chunk), *kv, "--out", str(out),
                    *map(str, ids)], check=True, timeout=300, env=env)
    return np.fromfile(out, dtype=np.float32).reshape(len(ids), -1)


@pytest.fixture(scope="module")
def oracle(default_model):
    return Oracle(default_model)


@pytest.fixture(scope="module")
def oracle_logits(baton_bin, default_model, oracle):
    """(ids, float64 oracle logits) of every prompt, computed once for both activation precisions."""
    out = []
    for text in PROMPTS:
        ids = tokenize(baton_bin, default_model, text)
        out.append((ids, oracle.logits(np.array(ids))))
    return out


# act_bits -> (least top-1 agreement, largest max relative logit error): the module docstring's figures
BOUNDS = {16: (1.0, 0.01), 8: (0.96, 0.30)}


@pytest.mark.parametrize("act_bits", sorted(BOUNDS, reverse=True))
def test_logits_match_numpy_oracle(baton_bin, default_model, oracle_logits, tmp_path, act_bits):
    total = agree = 0
    worst = 0.0
    for i, (ids, want) in enumerate(oracle_logits):
        got = baton_logits(baton_bin, default_model, ids, tmp_path, chunk=64, act_bits=act_bits)
        rel = np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)
        worst = max(worst, float(rel.max()))
        agree += int(np.sum(np.argmax(got, axis=1) == np.argmax(want, axis=1)))
        total += len(ids)
        print(f"prompt {i}: {len(ids)} positions, max rel err {rel.max():.4f}, "
              f"top-1 agree {np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1)):.4f}")
    print(f"overall ({act_bits}-bit activations): {total} positions, top-1 agreement {agree / total:.4f}, "
          f"max rel err {worst:.4f}")
    least_agree, most_err = BOUNDS[act_bits]
    assert total >= 1000
    assert agree / total >= least_agree, f"top-1 agreement {agree / total:.4f} at {act_bits} bits"
    assert worst < most_err, f"max relative logit error {worst:.4f} at {act_bits} bits"


def test_logits_chunking_is_bit_identical(baton_bin, default_model, tmp_path):
    ids = tokenize(baton_bin, default_model, PROMPTS[1])[:150]
    ref = baton_logits(baton_bin, default_model, ids, tmp_path, chunk=150)
    for chunk in (1, 7, 64):
        got = baton_logits(baton_bin, default_model, ids, tmp_path, chunk=chunk)
        assert np.array_equal(got, ref), f"chunk {chunk} changed the logits"


def test_int8_kv_agrees_with_f16(baton_bin, default_model, tmp_path):
    """int8 KV (asymmetric, a per-token-per-head fp16 scale and min: 53% of f16's bytes) keeps the f16-KV top-1 token
    at >= 99% of teacher-forced positions (99.3% measured; symmetric codes with one fp16 scale gave 98.6%)."""
    total = agree = 0
    for text in PROMPTS:
        ids = tokenize(baton_bin, default_model, text)
        outs = {}
        for dtype in ("f16", "int8"):
            out = tmp_path / f"logits-{dtype}.f32"
            subprocess.run([str(baton_bin), "logits", "--model", str(default_model), "--kv-dtype", dtype,
                            "--out", str(out), *map(str, ids)], check=True, timeout=300)
            outs[dtype] = np.fromfile(out, dtype=np.float32).reshape(len(ids), -1)
        agree += int(np.sum(np.argmax(outs["f16"], axis=1) == np.argmax(outs["int8"], axis=1)))
        total += len(ids)
    print(f"int8 vs f16 KV: top-1 agreement {agree / total:.4f} over {total} positions")
    assert total >= 1000 and agree / total >= 0.99


WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_tiny_model_of_every_weight_type(baton_bin, tmp_path, type_name):
    """The same float64 oracle on tiny random models that the project's GGUF writer makes with every weight type
    (embedding, projections and output matrix all of that type; tests/unit/engine/tiny_model_tool.c), with an f32
    KV cache so that the weight type is what is measured: 48 teacher-forced positions agree on the top-1 token, and
    the max relative logit error stays below 5e-3 (measured: 2e-7 F16/BF16, 3e-6 Q5_1/Q4_K/Q5_K, 1e-4 to 3e-4
    Q8_0/Q4_0/Q4_1, 8e-4 Q6_K, 9e-4 F32, 1.1e-3 Q5_0)."""
    tool = baton_bin.parent / "tiny_model_tool"
    path = tmp_path / f"tiny-{type_name}.gguf"
    subprocess.run([str(tool), str(path), type_name.lower()], check=True, timeout=60)
    ids = [int(x) for x in np.random.default_rng(5).integers(0, 256, size=48)]
    got = baton_logits(baton_bin, path, ids, tmp_path, chunk=16, kv_dtype="f32")
    want = Oracle(path).logits(np.array(ids))
    rel = np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)
    agree = float(np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1)))
    print(f"{type_name}: top-1 agreement {agree:.4f}, max rel err {rel.max():.2e}")
    assert agree == 1.0 and rel.max() < 5e-3, (type_name, agree, float(rel.max()))


def requantized(baton_bin, default_model, tmp_path_factory, qtype):
    path = tmp_path_factory.mktemp(qtype) / f"smollm2-{qtype}.gguf"
    subprocess.run([str(baton_bin), "model", "quantize", str(default_model), "--type", qtype, "--out", str(path)],
                   check=True, timeout=300, capture_output=True)
    return path


@pytest.fixture(scope="module")
def q4k_model(baton_bin, default_model, tmp_path_factory):
    """The default model with every matrix whose rows are a multiple of 256 (SmolLM2: ffn_down) requantized to Q4_K
    by `baton model quantize`: a K-quant file for the packed Q4_K kernels."""
    return requantized(baton_bin, default_model, tmp_path_factory, "q4_k")


@pytest.fixture(scope="module")
def q50_model(baton_bin, default_model, tmp_path_factory):
    """The default model with every matrix requantized to Q5_0: packed as nibbles and a high-bit plane (16-bit
    activations; into the Q8_0 layout at 8 bits)."""
    return requantized(baton_bin, default_model, tmp_path_factory, "q5_0")


@pytest.fixture(scope="module")
def q51_model(baton_bin, default_model, tmp_path_factory):
    """The default model with every matrix requantized to Q5_1: the packed Q5_1 layout (nibbles and a high-bit plane,
    fp16 d and m)."""
    return requantized(baton_bin, default_model, tmp_path_factory, "q5_1")


@pytest.fixture(scope="module")
def q6k_model(baton_bin, default_model, tmp_path_factory):
    """The default model with every matrix whose rows are a multiple of 256 (SmolLM2: ffn_down) requantized to Q6_K:
    the packed Q6_K layout (signed byte codes, fp32 d per 16-element half)."""
    return requantized(baton_bin, default_model, tmp_path_factory, "q6_k")


@pytest.fixture(scope="module")
def q5k_model(baton_bin, default_model, tmp_path_factory):
    """The default model's rows-of-256 matrices requantized to Q5_K: the packed Q5_K layout (fp32 d and m per
    32-element sub-block; on AVX-512 nibbles and a high-bit plane, elsewhere byte codes)."""
    return requantized(baton_bin, default_model, tmp_path_factory, "q5_k")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q5_0", "Q5_1", "Q6_K"])
def test_requantized_model_matches_numpy_oracle(baton_bin, request, qtype, tmp_path):
    """A requantized file against the oracle over gguf-py's own dequantization of its type (so baton's quantizer's
    choices do not matter, only that baton computes with what the file says): same bounds as the default model at
    16 bits."""
    model = request.getfixturevalue({"Q4_K": "q4k_model", "Q5_K": "q5k_model", "Q5_0": "q50_model",
                                     "Q5_1": "q51_model", "Q6_K": "q6k_model"}[qtype])
    oracle_q = Oracle(model)
    assert any(t.tensor_type.name == qtype for t in GGUFReader(str(model)).tensors)
    total = agree = 0
    worst = 0.0
    for text in PROMPTS[:3]:
        ids = tokenize(baton_bin, model, text)
        want = oracle_q.logits(np.array(ids))
        got = baton_logits(baton_bin, model, ids, tmp_path, chunk=64)
        worst = max(worst, float((np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)).max()))
        agree += int(np.sum(np.argmax(got, axis=1) == np.argmax(want, axis=1)))
        total += len(ids)
    print(f"{qtype} model: {total} positions, top-1 agreement {agree / total:.4f}, max rel err {worst:.4f}")
    assert total >= 400 and agree / total >= 0.99 and worst < 0.01, (total, agree / total, worst)


def test_embeddings_match_oracle(baton_bin, default_model):
    """`baton embed` (the scheduler's embedding requests: mean of the final hidden states over the text's tokens,
    L2-normalized) against the same pooling of the float64 oracle's hidden states: cosine >= 0.9999 for every text.
    The vectors are the same bits whatever the step's token budget (chunked prefill, texts batched together)."""
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", PROMPTS[0], PROMPTS[1]]
    runs = []
    for budget in ("512", "7"):
        r = subprocess.run([str(baton_bin), "embed", "--model", str(default_model), "--batch-tokens", budget, *texts],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout)
    assert runs[0] == runs[1]
    got = [np.array(json.loads(line)) for line in runs[0].splitlines()]
    assert len(got) == len(texts)
    oracle = Oracle(default_model)
    for text, g in zip(texts, got):
        h = oracle.hidden(np.array(tokenize(baton_bin, default_model, text)))
        want = h.mean(axis=0)
        want /= np.linalg.norm(want)
        cos = float(g @ want / np.linalg.norm(g))
        print(f"{len(h)} tokens: cosine {cos:.7f}, max abs diff {np.max(np.abs(g - want)):.2e}")
        assert abs(np.linalg.norm(g) - 1) < 1e-5 and cos >= 0.9999, (text, cos)
