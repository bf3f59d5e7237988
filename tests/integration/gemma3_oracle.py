"""An independent float64 numpy forward pass of a gemma3 GGUF over weights dequantized by gguf-py: the oracle
test_logits_oracle_gemma3.py checks baton against. Written from the architecture's description (Gemma 3 report,
Hugging Face's Gemma3 configuration), not from baton's code:
- the embedding rows times sqrt(n_embd); the output matrix is token_embd (tied);
- per layer: h = rmsnorm(x) * attn_norm; q, k, v projections; q and k RMS-normed per head (attn_q_norm, attn_k_norm);
  RoPE in the "half" (neox) layout, base 10,000 on sliding-window layers and rope.freq_base on global ones;
  scores q.k / sqrt(head_dim) under a causal mask, on sliding layers also masked where p - k >= sliding_window;
  the attention output projected, RMS-normed (post_attention_norm), added to x; then h = rmsnorm(x) * ffn_norm,
  gelu_tanh(gate) * up, down, RMS-normed (post_ffw_norm), added;
- every sixth layer (l % 6 == 5) global, the others local; the final output_norm.
The GGUF's norm weights are used as stored: its converter already folded Gemma's (1 + w) into them."""
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def deq32(t):
    """Dequantized weights as float32 [rows][row_len] (exact: every supported type's values fit in float32)."""
    a = dequantize(t.data, t.tensor_type)
    return np.asarray(a, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


class Gemma3Oracle:
    def __init__(self, path, window=None):
        r = GGUFReader(str(path))
        f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.")}
        assert f["general.architecture"] == "gemma3"
        a = "gemma3."
        self.n_layer = f[a + "block_count"]
        self.n_head = f[a + "attention.head_count"]
        self.n_kv = f[a + "attention.head_count_kv"]
        self.n_embd = f[a + "embedding_length"]
        self.hd = f[a + "attention.key_length"]
        self.base_global = f[a + "rope.freq_base"]
        self.base_local = 10000.0
        self.eps = f[a + "attention.layer_norm_rms_epsilon"]
        self.window = window if window is not None else f[a + "attention.sliding_window"]
        self.w = {t.name: deq32(t) for t in r.tensors}

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, base):
        # x [T][heads][hd]; pairs (i, i + hd/2)
        half = self.hd // 2
        inv = base ** (-np.arange(0, half) * 2.0 / self.hd)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)

    def hidden(self, ids):
        T = len(ids)
        W = lambda n: self.w[n].astype(np.float64)  # noqa: E731
        x = self.w["token_embd.weight"][ids].astype(np.float64) * np.sqrt(self.n_embd)
        pos = np.arange(T)
        qp, kp = pos[:, None], pos[None, :]
        causal = np.where(kp <= qp, 0.0, -np.inf)
        sliding = np.where((kp <= qp) & (qp - kp < self.window), 0.0, -np.inf)
        group = self.n_head // self.n_kv
        for l in range(self.n_layer):
            p = f"blk.{l}."
            glob = l % 6 == 5
            h = self.rmsnorm(x, W(p + "attn_norm.weight"))
            q = (h @ W(p + "attn_q.weight").T).reshape(T, self.n_head, self.hd)
            k = (h @ W(p + "attn_k.weight").T).reshape(T, self.n_kv, self.hd)
            v = (h @ W(p + "attn_v.weight").T).reshape(T, self.n_kv, self.hd)
            q = self.rmsnorm(q, W(p + "attn_q_norm.weight"))
            k = self.rmsnorm(k, W(p + "attn_k_norm.weight"))
            base = self.base_global if glob else self.base_local
            q, k = self.rope(q, pos, base), self.rope(k, pos, base)
            mask = causal if glob else sliding
            att = np.empty((T, self.n_head, self.hd))
            for hh in range(self.n_head):
                s = q[:, hh, :] @ k[:, hh // group, :].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, hh, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, hh // group, :]
            o = att.reshape(T, -1) @ W(p + "attn_output.weight").T
            x = x + self.rmsnorm(o, W(p + "post_attention_norm.weight"))
            h = self.rmsnorm(x, W(p + "ffn_norm.weight"))
            g = h @ W(p + "ffn_gate.weight").T
            u = h @ W(p + "ffn_up.weight").T
            gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            o = (gelu * u) @ W(p + "ffn_down.weight").T
            x = x + self.rmsnorm(o, W(p + "post_ffw_norm.weight"))
        return self.rmsnorm(x, W("output_norm.weight"))

    def logits(self, ids):
        """[T][n_vocab] float64 logits (the output matrix is token_embd: tied)."""
        h = self.hidden(ids)
        emb = self.w["token_embd.weight"]
        out = np.empty((len(ids), emb.shape[0]))
        for v0 in range(0, emb.shape[0], 32768):
            out[:, v0:v0 + 32768] = h @ emb[v0:v0 + 32768].astype(np.float64).T
        return out

    def compare(self, ids, got):
        """Compares got ([T][n_vocab], e.g. a memmap of baton's float32 logits) with the oracle's logits a vocabulary
        slice at a time (the float64 logits of a long sequence would not fit in memory). Returns per position
        (oracle argmax, got argmax, max |got - oracle| / max |oracle|)."""
        h = self.hidden(ids)
        emb = self.w["token_embd.weight"]
        T = len(ids)
        best_w, arg_w = np.full(T, -np.inf), np.zeros(T, dtype=np.int64)
        best_g, arg_g = np.full(T, -np.inf), np.zeros(T, dtype=np.int64)
        err, scale = np.zeros(T), np.zeros(T)
        for v0 in range(0, emb.shape[0], 16384):
            want = h @ emb[v0:v0 + 16384].astype(np.float64).T
            g = np.asarray(got[:, v0:v0 + 16384], dtype=np.float64)
            err = np.maximum(err, np.max(np.abs(g - want), axis=1))
            scale = np.maximum(scale, np.max(np.abs(want), axis=1))
            for best, arg, x in ((best_w, arg_w, want), (best_g, arg_g, g)):
                a = np.argmax(x, axis=1)
                m = x[np.arange(T), a]
                up = m > best
                best[up], arg[up] = m[up], a[up] + v0
        return arg_w, arg_g, err / scale
