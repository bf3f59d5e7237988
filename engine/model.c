#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_quants.h"
#include "engine/ggml_type.h"

static int arch_supported(const char *a)
{
    static const char *const ok[] = {"llama", "mistral", "qwen2", "granite", "gemma3"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (!strcmp(a, ok[i])) return 1;
    return 0;
}

static bt_status get_i32(const gguf_file *f, const char *arch, const char *suffix, int32_t *out, int32_t dflt,
                         int required)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v;
    bt_status st = gguf_get_u32(f, key, &v);
    if (st == BT_ERR_NOT_FOUND && !required) {
        *out = dflt;
        return BT_OK;
    }
    if (st) return st;
    if (v == 0 || v > (1u << 30)) return bt_fail(BT_ERR_FORMAT, "model key '%s' has an invalid value %u", key, v);
    *out = (int32_t)v;
    return BT_OK;
}

/* Looks up a tensor and checks its shape (n_in x n_out) and that the CPU kernels can use its type. */
static bt_status weight(const gguf_file *f, const char *name, int64_t n_in, int64_t n_out, int optional,
                        bt_weight *w)
{
    memset(w, 0, sizeof *w);
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) {
        if (optional) return BT_OK;
        return bt_fail(BT_ERR_FORMAT, "model tensor '%s' is missing", name);
    }
    uint64_t want_rows = (uint64_t)n_out;
    uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
    if (t->ne[0] != (uint64_t)n_in || rows != want_rows)
        return bt_fail(BT_ERR_FORMAT, "model tensor '%s' has shape %llu x %llu, expected %lld x %lld", name,
                       (unsigned long long)t->ne[0], (unsigned long long)rows, (long long)n_in, (long long)n_out);
    if (bt_cpu_act_format(t->type, 16) == BT_ACT_NONE)
        return bt_fail(BT_ERR_UNSUPPORTED, "model tensor '%s' has weight type %s, which baton does not support", name,
                       bt_ggml_type_name(t->type));
    w->type = t->type;
    w->n_in = n_in;
    w->n_out = n_out;
    w->data = t->data;
    return BT_OK;
}

/* An optional f32 key that must be finite and positive when present. */
static bt_status get_pos_f32(const gguf_file *f, const char *arch, const char *suffix, float *out, float dflt)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    bt_status st = gguf_get_f32(f, key, out);
    if (st == BT_ERR_NOT_FOUND) {
        *out = dflt;
        return BT_OK;
    }
    if (st) return st;
    if (!(*out > 0) || !isfinite(*out)) return bt_fail(BT_ERR_FORMAT, "model key '%s' has an invalid value %g", key, *out);
    return BT_OK;
}

/* Gemma 3 (text): every layer's attention is local (a sliding window, RoPE base 10,000) except every sixth, which is
 * global (rope.freq_base); the GGUF keeps the window but not the pattern, which the architecture fixes (llama.cpp
 * and Hugging Face's sliding_window_pattern = 6). Scores are scaled by 1 / sqrt(query_pre_attn_scalar), which is
 * head_dim for the released sizes except 27B (the key, when a file has it, wins). The norms' weights are stored as
 * used (the converter folds Gemma's 1 + w into the file), so they multiply as in the llama family. */
static bt_status load_gemma3(const gguf_file *f, bt_hparams *hp)
{
    const char *a = hp->arch;
    bt_status st;
    hp->gemma = 1;
    hp->rope_neox = 1;
    hp->embd_scale = sqrtf((float)hp->n_embd);
    if ((st = get_i32(f, a, "attention.sliding_window", &hp->swa_window, 0, 1))) return st;
    int32_t pattern;
    if ((st = get_i32(f, a, "attention.sliding_window_pattern", &pattern, 6, 0))) return st;
    hp->swa_pattern = pattern;
    if ((st = get_pos_f32(f, a, "rope.local.freq_base", &hp->rope_base_local, 10000.0f))) return st;
    float qpas;
    if ((st = get_pos_f32(f, a, "attention.query_pre_attn_scalar", &qpas, (float)hp->head_dim))) return st;
    hp->attn_scale = 1.0f / sqrtf(qpas);
    int32_t vlen;
    if ((st = get_i32(f, a, "attention.value_length", &vlen, hp->head_dim, 0))) return st;
    if (vlen != hp->head_dim)
        return bt_fail(BT_ERR_UNSUPPORTED, "model key '%s.attention.value_length' (%d) differs from key_length (%d)", a,
                       vlen, hp->head_dim);
    if (hp->n_rot != hp->head_dim)
        return bt_fail(BT_ERR_FORMAT, "model key '%s.rope.dimension_count' (%d) must equal head_dim (%d) for gemma3", a,
                       hp->n_rot, hp->head_dim);
    static const char *const softcaps[] = {"final_logit_softcapping", "attn_logit_softcapping"};
    for (int i = 0; i < 2; i++) { /* Gemma 2 has them; Gemma 3 dropped them: refuse rather than ignore */
        char key[128];
        float cap = 0;
        snprintf(key, sizeof key, "%s.%s", a, softcaps[i]);
        if (gguf_get_f32(f, key, &cap) == BT_OK && cap != 0.0f)
            return bt_fail(BT_ERR_UNSUPPORTED, "model key '%s' is set (%g): logit soft-capping is not supported", key,
                           cap);
    }
    return BT_OK;
}

static bt_status load_hparams(const gguf_file *f, bt_hparams *hp)
{
    memset(hp, 0, sizeof *hp);
    gguf_str arch;
    bt_status st = gguf_get_str(f, "general.architecture", &arch);
    if (st) return st;
    gguf_str_copy(arch, hp->arch, sizeof hp->arch);
    if (!arch_supported(hp->arch))
        return bt_fail(BT_ERR_UNSUPPORTED, "model architecture '%s' is not supported (llama, mistral, qwen2, granite, gemma3)", hp->arch);
    const char *a = hp->arch;
    if ((st = get_i32(f, a, "block_count", &hp->n_layer, 0, 1))) return st;
    if ((st = get_i32(f, a, "embedding_length", &hp->n_embd, 0, 1))) return st;
    if ((st = get_i32(f, a, "attention.head_count", &hp->n_head, 0, 1))) return st;
    if ((st = get_i32(f, a, "attention.head_count_kv", &hp->n_head_kv, hp->n_head, 0))) return st;
    if ((st = get_i32(f, a, "feed_forward_length", &hp->n_ff, 0, 1))) return st;
    if ((st = get_i32(f, a, "context_length", &hp->n_ctx_train, 2048, 0))) return st;
    if (hp->n_embd % hp->n_head) return bt_fail(BT_ERR_FORMAT, "embedding_length is not a multiple of head_count");
    if ((st = get_i32(f, a, "attention.key_length", &hp->head_dim, hp->n_embd / hp->n_head, 0))) return st;
    if ((st = get_i32(f, a, "rope.dimension_count", &hp->n_rot, hp->head_dim, 0))) return st;
    if (hp->head_dim > 256 || hp->head_dim % 8)
        return bt_fail(BT_ERR_UNSUPPORTED, "head_dim %d is not supported (a multiple of 8, at most 256)", hp->head_dim);
    if (hp->n_head % hp->n_head_kv)
        return bt_fail(BT_ERR_FORMAT, "head_count %d is not a multiple of head_count_kv %d", hp->n_head, hp->n_head_kv);
    if (hp->n_head / hp->n_head_kv > 16)
        return bt_fail(BT_ERR_UNSUPPORTED, "more than 16 query heads per kv head (%d / %d) is not supported",
                       hp->n_head, hp->n_head_kv);
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 || hp->head_dim % 2)
        return bt_fail(BT_ERR_FORMAT, "rope dimension %d does not fit head_dim %d", hp->n_rot, hp->head_dim);
    char key[128];
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    if (gguf_get_f32(f, key, &hp->rope_base) == BT_ERR_NOT_FOUND) hp->rope_base = 10000.0f;
    hp->rope_freq_scale = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    gguf_str stype;
    if (gguf_get_str(f, key, &stype) == BT_OK && !gguf_str_eq(stype, "none")) {
        float factor = 1.0f;
        snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
        gguf_get_f32(f, key, &factor);
        if (!gguf_str_eq(stype, "linear"))
            return bt_fail(BT_ERR_UNSUPPORTED, "rope scaling type '%.*s' is not supported (linear only)",
                           (int)stype.len, stype.ptr);
        if (factor > 0) hp->rope_freq_scale = 1.0f / factor;
    }
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    if ((st = gguf_get_f32(f, key, &hp->rms_eps))) return st;
    hp->rope_neox = !strcmp(a, "qwen2");
    hp->embd_scale = 1.0f;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    if (!strcmp(a, "gemma3") && (st = load_gemma3(f, hp))) return st;
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (!emb) return bt_fail(BT_ERR_FORMAT, "model tensor 'token_embd.weight' is missing");
    hp->n_vocab = (int32_t)emb->ne[1];
    return BT_OK;
}

bt_status bt_model_from_gguf(gguf_file *f, const char *path, bt_model **out)
{
    bt_model *m = calloc(1, sizeof *m);
    if (!m) return bt_fail(BT_ERR_NOMEM, "out of memory loading a model");
    bt_status st = load_hparams(f, &m->hp);
    if (st) goto fail;
    const bt_hparams *hp = &m->hp;
    int64_t q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    if ((st = weight(f, "token_embd.weight", hp->n_embd, hp->n_vocab, 0, &m->tok_embd))) goto fail;
    if ((st = weight(f, "output_norm.weight", hp->n_embd, 1, 0, &m->output_norm))) goto fail;
    if ((st = weight(f, "output.weight", hp->n_embd, hp->n_vocab, 1, &m->output))) goto fail;
    if (!m->output.data) m->output = m->tok_embd; /* tied embeddings */
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory loading a model");
        goto fail;
    }
    for (int32_t l = 0; l < hp->n_layer; l++) {
        bt_layer *L = &m->layers[l];
        char n[96];
#define W(field, suffix, nin, nout, opt)                                    \
    snprintf(n, sizeof n, "blk.%d.%s", l, suffix);                          \
    if ((st = weight(f, n, nin, nout, opt, &L->field))) goto fail;
        W(attn_norm, "attn_norm.weight", hp->n_embd, 1, 0)
        W(wq, "attn_q.weight", hp->n_embd, q_dim, 0)
        W(wk, "attn_k.weight", hp->n_embd, kv_dim, 0)
        W(wv, "attn_v.weight", hp->n_embd, kv_dim, 0)
        W(wo, "attn_output.weight", q_dim, hp->n_embd, 0)
        W(bq, "attn_q.bias", q_dim, 1, 1)
        W(bk, "attn_k.bias", kv_dim, 1, 1)
        W(bv, "attn_v.bias", kv_dim, 1, 1)
        W(ffn_norm, "ffn_norm.weight", hp->n_embd, 1, 0)
        W(w_gate, "ffn_gate.weight", hp->n_embd, hp->n_ff, 0)
        W(w_up, "ffn_up.weight", hp->n_embd, hp->n_ff, 0)
        W(w_down, "ffn_down.weight", hp->n_ff, hp->n_embd, 0)
        if (hp->gemma) {
            W(q_norm, "attn_q_norm.weight", hp->head_dim, 1, 0)
            W(k_norm, "attn_k_norm.weight", hp->head_dim, 1, 0)
            W(post_attn_norm, "post_attention_norm.weight", hp->n_embd, 1, 0)
            W(post_ffn_norm, "post_ffw_norm.weight", hp->n_embd, 1, 0)
        }
#undef W
        if (L->bq.data) m->hp.has_qkv_bias = 1;
        L->rope_base = hp->rope_base;
        if (hp->swa_pattern && l % hp->swa_pattern != hp->swa_pattern - 1) { /* a local (sliding-window) layer */
            L->window = hp->swa_window;
            L->rope_base = hp->rope_base_local;
        }
        const bt_weight *vecs[] = {&L->attn_norm, &L->ffn_norm, &L->bq,     &L->bk,
                                   &L->bv,        &L->q_norm,   &L->k_norm, &L->post_attn_norm,
                                   &L->post_ffn_norm};
        for (size_t i = 0; i < sizeof vecs / sizeof vecs[0]; i++)
            if (vecs[i]->data && vecs[i]->type != BT_TYPE_F32) {
                st = bt_fail(BT_ERR_UNSUPPORTED, "layer %d: norm/bias tensors must be F32, found %s", l,
                             bt_ggml_type_name(vecs[i]->type));
                goto fail;
            }
    }
    if (m->output_norm.type != BT_TYPE_F32) {
        st = bt_fail(BT_ERR_UNSUPPORTED, "output_norm.weight must be F32");
        goto fail;
    }
    gguf_str name;
    if (gguf_get_str(f, "general.name", &name) == BT_OK && name.len) {
        gguf_str_copy(name, m->name, sizeof m->name);
    } else {
        const char *base = path ? strrchr(path, '/') : NULL;
        snprintf(m->name, sizeof m->name, "%s", base ? base + 1 : (path ? path : "model"));
    }
    m->fingerprint = gguf_fingerprint(f);
    m->file = f;
    *out = m;
    return BT_OK;
fail:
    free(m->layers);
    free(m);
    return st;
}

bt_status bt_model_load(const char *path, bt_model **out)
{
    gguf_file *f;
    bt_status st = gguf_open(path, &f);
    if (st) return st;
    st = bt_model_from_gguf(f, path, out);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        bt_fail(st, "%s: %s", path, msg);
        gguf_close(f);
    }
    return st;
}

void bt_model_free(bt_model *m)
{
    if (!m) return;
    gguf_close(m->file);
    free(m->layers);
    free(m);
}

static uint64_t wbytes(const bt_weight *w)
{
    return w->data ? (uint64_t)bt_cpu_row_bytes(w->type, w->n_in) * (uint64_t)w->n_out : 0;
}

uint64_t bt_model_weight_bytes(const bt_model *m)
{
    uint64_t b = wbytes(&m->output) + wbytes(&m->output_norm);
    for (int32_t l = 0; l < m->hp.n_layer; l++) {
        const bt_layer *L = &m->layers[l];
        b += wbytes(&L->attn_norm) + wbytes(&L->wq) + wbytes(&L->wk) + wbytes(&L->wv) + wbytes(&L->wo) +
             wbytes(&L->ffn_norm) + wbytes(&L->w_gate) + wbytes(&L->w_up) + wbytes(&L->w_down);
    }
    return b;
}

static uint64_t macs(const bt_weight *w)
{
    return w->data ? (uint64_t)w->n_in * (uint64_t)w->n_out : 0;
}

uint64_t bt_model_matmul_macs(const bt_model *m)
{
    uint64_t n = macs(&m->output);
    for (int32_t l = 0; l < m->hp.n_layer; l++) {
        const bt_layer *L = &m->layers[l];
        n += macs(&L->wq) + macs(&L->wk) + macs(&L->wv) + macs(&L->wo) + macs(&L->w_gate) + macs(&L->w_up) +
             macs(&L->w_down);
    }
    return n;
}
