#include "tiny_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/ggml_type.h"
#include "engine/gguf_writer.h"
#include "test_util.h"

void tiny_model_defaults(tiny_model_opts *o)
{
    if (!o->arch) o->arch = "llama";
    if (!o->n_layer) o->n_layer = 2;
    if (!o->n_embd) o->n_embd = 64;
    if (!o->n_head) o->n_head = 4;
    if (!o->n_head_kv) o->n_head_kv = 2;
    if (!o->n_ff) o->n_ff = 128;
    if (!o->n_vocab) o->n_vocab = 256;
    if (!o->matrix_type) o->matrix_type = BT_TYPE_Q4_1;
    if (!o->embd_type) o->embd_type = BT_TYPE_Q8_0;
    if (!o->seed) o->seed = 42;
}

static float frand(uint64_t *s)
{
    return (float)((test_rand_next(s) >> 11) * 0x1p-53) * 2.0f - 1.0f;
}

/* Random blocks of a quantized type with sane scales: every byte random, then the f16 scale fields set. */
static uint8_t *random_tensor(uint32_t type, int64_t n_in, int64_t n_out, float scale, uint64_t *s, size_t *bytes)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(type);
    size_t nb = (size_t)(n_in / ti->block_elems) * (size_t)n_out;
    *bytes = nb * ti->block_bytes;
    uint8_t *p = malloc(*bytes);
    for (size_t i = 0; i < *bytes; i++) p[i] = (uint8_t)test_rand_next(s);
    for (size_t b = 0; b < nb; b++) {
        uint8_t *blk = p + b * ti->block_bytes;
        uint16_t d = bt_f32_to_fp16(scale * (0.5f + 0.5f * fabsf(frand(s))));
        uint16_t m = bt_f32_to_fp16(-8.0f * scale * (0.5f + 0.5f * fabsf(frand(s))));
        switch (type) {
        case BT_TYPE_F32:
            for (int i = 0; i < 1; i++) {
                float v = scale * frand(s);
                memcpy(blk, &v, 4);
            }
            break;
        case BT_TYPE_F16: {
            uint16_t v = bt_f32_to_fp16(scale * frand(s));
            memcpy(blk, &v, 2);
            break;
        }
        case BT_TYPE_BF16: { /* random bytes would hold NaNs and infinities */
            uint16_t v = bt_f32_to_bf16(scale * frand(s));
            memcpy(blk, &v, 2);
            break;
        }
        case BT_TYPE_Q8_0: d = bt_f32_to_fp16(scale / 127.0f * 4); memcpy(blk, &d, 2); break;
        case BT_TYPE_Q4_0: case BT_TYPE_Q5_0: memcpy(blk, &d, 2); break;
        case BT_TYPE_Q4_1: case BT_TYPE_Q5_1: memcpy(blk, &d, 2); memcpy(blk + 2, &m, 2); break;
        case BT_TYPE_Q4_K: case BT_TYPE_Q5_K: {
            uint16_t dk = bt_f32_to_fp16(scale / 16), mk = bt_f32_to_fp16(scale / 32);
            memcpy(blk, &dk, 2);
            memcpy(blk + 2, &mk, 2);
            break;
        }
        case BT_TYPE_Q6_K: {
            uint16_t dk = bt_f32_to_fp16(scale / 512);
            memcpy(blk + ti->block_bytes - 2, &dk, 2);
            break;
        }
        default: break;
        }
    }
    return p;
}

static int add(gguf_writer *w, const tiny_model_opts *o, const char *name, uint32_t type, int64_t n_in,
               int64_t n_out, float scale, uint64_t *s)
{
    if (o->skip_tensor && !strcmp(o->skip_tensor, name)) return 0;
    size_t bytes;
    uint8_t *data;
    if (type == BT_TYPE_F32 && n_out == 1) { /* norm weights: around 1 */
        bytes = (size_t)n_in * 4;
        data = malloc(bytes);
        for (int64_t i = 0; i < n_in; i++) ((float *)data)[i] = 1.0f + 0.2f * frand(s);
    } else {
        data = random_tensor(type, n_in, n_out, scale, s, &bytes);
    }
    uint64_t ne[2] = {(uint64_t)n_in, (uint64_t)n_out};
    int rc = gguf_writer_add_tensor(w, name, type, n_out == 1 ? 1 : 2, ne, data, bytes) == BT_OK ? 0 : -1;
    free(data);
    return rc;
}

int tiny_model_write(const char *path, const tiny_model_opts *in)
{
    tiny_model_opts o = *in;
    tiny_model_defaults(&o);
    uint64_t s = o.seed;
    gguf_writer *w = gguf_writer_create();
    char key[128];
    int rc = 0;
    const char *a = o.arch;
    gguf_writer_add_str(w, "general.architecture", a);
    gguf_writer_add_str(w, "general.name", "tiny test model");
#define KU(suffix, v) snprintf(key, sizeof key, "%s.%s", a, suffix), gguf_writer_add_u32(w, key, (uint32_t)(v))
    KU("block_count", o.n_layer);
    KU("embedding_length", o.n_embd);
    KU("attention.head_count", o.n_head);
    KU("attention.head_count_kv", o.n_head_kv);
    KU("feed_forward_length", o.n_ff);
    KU("context_length", 1024);
    int gemma = !strcmp(a, "gemma3");
    if (gemma && o.swa_window >= 0) KU("attention.sliding_window", o.swa_window ? o.swa_window : 8);
    if (gemma && o.swa_pattern) KU("attention.sliding_window_pattern", o.swa_pattern);
#undef KU
    if (gemma && o.softcap != 0) {
        snprintf(key, sizeof key, "%s.final_logit_softcapping", a);
        gguf_writer_add_f32(w, key, o.softcap);
    }
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    gguf_writer_add_f32(w, key, 10000.0f);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    gguf_writer_add_f32(w, key, 1e-5f);
    int hd = o.n_embd / o.n_head;
    rc |= add(w, &o, "token_embd.weight", o.embd_type, o.n_embd, o.n_vocab, 1.0f, &s);
    rc |= add(w, &o, "output_norm.weight", BT_TYPE_F32, o.n_embd, 1, 1.0f, &s);
    if (!o.tied) rc |= add(w, &o, "output.weight", o.matrix_type, o.n_embd, o.n_vocab, 0.1f, &s);
    for (int l = 0; l < o.n_layer; l++) {
        char n[64];
#define T(suffix, type, nin, nout, sc) snprintf(n, sizeof n, "blk.%d.%s", l, suffix), rc |= add(w, &o, n, type, nin, nout, sc, &s)
        T("attn_norm.weight", BT_TYPE_F32, o.n_embd, 1, 1.0f);
        T("attn_q.weight", o.matrix_type, o.n_embd, o.n_head * hd, 0.05f);
        T("attn_k.weight", o.matrix_type, o.n_embd, o.n_head_kv * hd, 0.05f);
        T("attn_v.weight", o.matrix_type, o.n_embd, o.n_head_kv * hd, 0.05f);
        T("attn_output.weight", o.matrix_type, o.n_head * hd, o.n_embd, 0.05f);
        T("ffn_norm.weight", BT_TYPE_F32, o.n_embd, 1, 1.0f);
        T("ffn_gate.weight", o.matrix_type, o.n_embd, o.n_ff, 0.05f);
        T("ffn_up.weight", o.matrix_type, o.n_embd, o.n_ff, 0.05f);
        T("ffn_down.weight", o.matrix_type, o.n_ff, o.n_embd, 0.05f);
        if (gemma) {
            T("attn_q_norm.weight", BT_TYPE_F32, hd, 1, 1.0f);
            T("attn_k_norm.weight", BT_TYPE_F32, hd, 1, 1.0f);
            T("post_attention_norm.weight", BT_TYPE_F32, o.n_embd, 1, 1.0f);
            T("post_ffw_norm.weight", BT_TYPE_F32, o.n_embd, 1, 1.0f);
        }
#undef T
    }
    if (!rc && gguf_writer_write_file(w, path) != BT_OK) rc = -1;
    gguf_writer_free(w);
    return rc;
}
