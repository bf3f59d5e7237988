/* A llama-family model loaded from GGUF: hyper-parameters and references to the weight tensors in the mapping.
 * Immutable after bt_model_load; shared read-only by every thread. Per-request state lives elsewhere. */
#ifndef BATON_ENGINE_MODEL_H
#define BATON_ENGINE_MODEL_H

#include <stdint.h>

#include "common/status.h"
#include "engine/gguf.h"

typedef struct bt_hparams {
    char arch[32];         /* "llama", "mistral", "qwen2" ... */
    int32_t n_layer;
    int32_t n_embd;        /* d_model */
    int32_t n_head;        /* query heads */
    int32_t n_head_kv;     /* key/value heads (GQA when < n_head) */
    int32_t head_dim;      /* key_length, else n_embd / n_head */
    int32_t n_ff;          /* SwiGLU hidden size */
    int32_t n_vocab;
    int32_t n_ctx_train;   /* context length the model was trained for */
    int32_t n_rot;         /* rotated dims per head (rope.dimension_count, default head_dim) */
    float rope_base;       /* rope.freq_base (default 10000) */
    float rope_freq_scale; /* 1 / rope.scaling.factor for linear scaling, else 1 */
    int rope_neox;         /* 1: rotate pairs (i, i + n_rot/2) (qwen2 ...); 0: adjacent pairs (llama GGUF) */
    float rms_eps;
    int has_qkv_bias;      /* qwen2-style q/k/v biases */
    /* gemma3 (0 / 1 / unset for the llama family): */
    int gemma;             /* q/k RMSNorm per head, post-norms on both sub-layer outputs, GeGLU (tanh GELU) */
    float embd_scale;      /* the embedding rows are multiplied by this (sqrt(n_embd)); 1: none */
    float attn_scale;      /* scores are q.k * attn_scale (1 / sqrt(query_pre_attn_scalar or head_dim)) */
    int32_t swa_window;    /* sliding window of the local layers (a query at p sees keys k with p - k < window) */
    int32_t swa_pattern;   /* every swa_pattern-th layer (l % pattern == pattern - 1) is global; 0: all global */
    float rope_base_local; /* RoPE base of the sliding-window layers */
} bt_hparams;

/* One tensor of weights: type and shape from the file, data in the mapping. */
typedef struct bt_weight {
    uint32_t type;   /* bt_ggml_type */
    int64_t n_in;    /* ne[0]: row length */
    int64_t n_out;   /* ne[1]: rows (1 for vectors) */
    const void *data;
} bt_weight;

typedef struct bt_layer {
    bt_weight attn_norm;          /* [n_embd] */
    bt_weight wq, wk, wv, wo;     /* [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd] */
    bt_weight bq, bk, bv;         /* optional biases (data NULL when absent) */
    bt_weight ffn_norm;           /* [n_embd] */
    bt_weight w_gate, w_up;       /* [n_ff][n_embd] */
    bt_weight w_down;             /* [n_embd][n_ff] */
    /* gemma3 only (data NULL otherwise): */
    bt_weight q_norm, k_norm;     /* [head_dim], applied to every head before RoPE */
    bt_weight post_attn_norm;     /* [n_embd] on the attention output before the residual add */
    bt_weight post_ffn_norm;      /* [n_embd] on the FFN output before the residual add */
    int32_t window;               /* attention window (0: every earlier position) */
    float rope_base;              /* this layer's RoPE frequency base */
} bt_layer;

typedef struct bt_model {
    gguf_file *file;       /* owns the mapping every bt_weight points into */
    bt_hparams hp;
    bt_weight tok_embd;    /* [n_vocab][n_embd] */
    bt_weight output_norm; /* [n_embd] */
    bt_weight output;      /* [n_vocab][n_embd]; the same data as tok_embd when tied */
    bt_layer *layers;      /* [n_layer] */
    char name[128];        /* general.name, else the file's base name */
    uint64_t fingerprint;  /* gguf_fingerprint of the file: identifies the model in KV layouts and to the router */
} bt_model;

/* Loads and validates the model at path: architecture in the llama family or gemma3, every tensor present with the expected
 * shape and a supported type. Errors: those of gguf_open, BT_ERR_UNSUPPORTED (architecture or weight type, named),
 * BT_ERR_FORMAT (missing tensor or key, wrong shape, named), BT_ERR_NOMEM. *out only set on success. */
bt_status bt_model_load(const char *path, bt_model **out);

/* Same from an already opened file; takes ownership of f on success only. */
bt_status bt_model_from_gguf(gguf_file *f, const char *path, bt_model **out);

/* NULL allowed. */
void bt_model_free(bt_model *m);

/* Bytes of weights read per decoded token (all matrices and the output matrix): the decode roofline's numerator. */
uint64_t bt_model_weight_bytes(const bt_model *m);
/* Multiply-accumulates of the matmuls of one token's forward pass (every layer's projections and the output matrix;
 * attention's own products not included). */
uint64_t bt_model_matmul_macs(const bt_model *m);

#endif
