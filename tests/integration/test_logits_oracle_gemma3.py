"""baton's gemma3 forward pass (Gemma 3 270M, Q4_K_M: Q8_0, Q5_0, Q4_K, Q6_K and F32 tensors) against the float64
numpy oracle of gemma3_oracle.py over gguf-py's dequantization, teacher-forced, with the SmolLM2 test's bounds.

One long sequence (the SmolLM2 test's eight prompts joined: 942 tokens) runs past the 512-token sliding window, so
positions 512.. check that the local layers see only their window and the global ones everything; two prompts on
their own add short-context positions (1,243 positions in all).

Measured with 16-bit activations (the default) and f16 KV on AVX-512: top-1 agreement 100% (past the window too) and
a max relative logit error (max |baton - oracle| / max |oracle| per position) of 0.23% (0.12% past the window);
asserted with the SmolLM2 test's bounds: top-1 >= 99% (the issue's figure) and < 1%.
With 8-bit activations (BATON_ACT_BITS=8, an option) Gemma does worse than SmolLM2 (95.3% top-1, max relative error
48.1% at one position, vs SmolLM2's 96% / 30% bounds; AVX-512 and AVX2 alike): its residual stream is large (the
embedding is scaled by sqrt(640) and the norm weights reach 300), so 8-bit blocks lose more. Before the K-quants had
packed 8-bit kernels (their per-row kernels sum a block's scales in another float order) it measured 95.6% and 42.7%.
That run asserts bounds of its own, just outside the measurement (95%, 50%), as a regression guard, not as SmolLM2's
figure.
"""
import subprocess

import numpy as np
import pytest

from gemma3_oracle import Gemma3Oracle
from test_logits_oracle import PROMPTS, tokenize

BOS = 2


def sequences(baton_bin, model):
    long = [BOS] + tokenize(baton_bin, model, "\n\n".join(PROMPTS))
    return [long, [BOS] + tokenize(baton_bin, model, PROMPTS[0]), [BOS] + tokenize(baton_bin, model, PROMPTS[4])]


def baton_logits_mm(baton_bin, model, ids, path, chunk, act_bits=None):
    """baton's float32 logits of every position, memory-mapped ([T][262144] is 1 GB for the long sequence)."""
    env = None
    if act_bits:
        import os
        env = dict(os.environ, BATON_ACT_BITS=str(act_bits))
    subprocess.run([str(baton_bin), "logits", "--model", str(model), "--chunk", str(chunk), "--out", str(path),
                    *map(str, ids)], check=True, timeout=600, env=env)
    return np.memmap(path, dtype=np.float32, mode="r").reshape(len(ids), -1)


@pytest.fixture(scope="module")
def oracle(gemma3_model):
    return Gemma3Oracle(gemma3_model)


# act_bits -> (least top-1 agreement, largest max relative logit error): SmolLM2's bounds (test_logits_oracle.py)
# 16 bits: SmolLM2's bounds; 8 bits: Gemma's own, just outside its measurement (see the module docstring)
BOUNDS = {16: (0.99, 0.01), 8: (0.95, 0.50)}


@pytest.mark.parametrize("act_bits", sorted(BOUNDS, reverse=True))
def test_gemma3_logits_match_numpy_oracle(baton_bin, gemma3_model, oracle, tmp_path, act_bits):
    total = agree = 0
    worst = 0.0
    for i, ids in enumerate(sequences(baton_bin, gemma3_model)):
        got = baton_logits_mm(baton_bin, gemma3_model, ids, tmp_path / "logits.f32", chunk=128, act_bits=act_bits)
        arg_w, arg_g, rel = oracle.compare(np.array(ids), got)
        del got
        same = arg_w == arg_g
        agree += int(same.sum())
        total += len(ids)
        worst = max(worst, float(rel.max()))
        extra = ""
        if len(ids) > oracle.window:
            w = oracle.window
            extra = (f"; past the window (positions {w}..{len(ids) - 1}): top-1 {same[w:].mean():.4f}, "
                     f"max rel err {rel[w:].max():.4f}")
        print(f"sequence {i}: {len(ids)} positions, top-1 agree {same.mean():.4f}, max rel err {rel.max():.4f}{extra}")
    print(f"overall ({act_bits}-bit activations): {total} positions, top-1 agreement {agree / total:.4f}, "
          f"max rel err {worst:.4f}")
    least_agree, most_err = BOUNDS[act_bits]
    assert total >= 1000
    assert agree / total >= least_agree, f"top-1 agreement {agree / total:.4f} at {act_bits} bits"
    assert worst < most_err, f"max relative logit error {worst:.4f} at {act_bits} bits"


def test_gemma3_chunking_is_bit_identical(baton_bin, gemma3_model, tmp_path):
    """Batch invariance on gemma3: 600 positions (past the sliding window) give the same bits whether the prompt
    runs whole or in chunks of 1, 7 or 64 tokens (chunks that start before, at and after the window's edge)."""
    ids = sequences(baton_bin, gemma3_model)[0][:600]
    ref = np.array(baton_logits_mm(baton_bin, gemma3_model, ids, tmp_path / "ref.f32", chunk=600))
    for chunk in (1, 7, 64):
        got = baton_logits_mm(baton_bin, gemma3_model, ids, tmp_path / f"c{chunk}.f32", chunk=chunk)
        assert np.array_equal(got, ref), f"chunk {chunk} changed the logits"
