#include "engine/gguf_slice.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/gguf_writer.h"

/* Copies one array key. Strings, 32-bit integers and floats are what GGUF tokenizers and models use. */
static bt_status copy_array(gguf_writer *w, const char *key, const gguf_kv *kv)
{
    uint64_t n = kv->arr_len;
    bt_status st = BT_OK;
    if (kv->arr_type == GGUF_VT_STRING) {
        const char **v = malloc(sizeof(char *) * (size_t)(n ? n : 1));
        size_t *lens = malloc(sizeof(size_t) * (size_t)(n ? n : 1));
        if (!v || !lens) st = bt_fail(BT_ERR_NOMEM, "out of memory copying %s", key);
        for (uint64_t i = 0; !st && i < n; i++) {
            gguf_str s = gguf_arr_str(kv, i);
            v[i] = s.ptr;
            lens[i] = (size_t)s.len;
        }
        if (!st) st = gguf_writer_add_arr_str(w, key, v, lens, n);
        free(v);
        free(lens);
        return st;
    }
    if (kv->arr_type == GGUF_VT_INT32 || kv->arr_type == GGUF_VT_FLOAT32) {
        void *v = malloc(4 * (size_t)(n ? n : 1));
        if (!v) return bt_fail(BT_ERR_NOMEM, "out of memory copying %s", key);
        for (uint64_t i = 0; i < n; i++) {
            if (kv->arr_type == GGUF_VT_INT32) ((int32_t *)v)[i] = (int32_t)gguf_arr_int(kv, i);
            else ((float *)v)[i] = (float)gguf_arr_float(kv, i);
        }
        st = kv->arr_type == GGUF_VT_INT32 ? gguf_writer_add_arr_i32(w, key, v, n)
                                           : gguf_writer_add_arr_f32(w, key, v, n);
        free(v);
        return st;
    }
    return bt_fail(BT_ERR_UNSUPPORTED, "cannot copy key %s: arrays of %s", key, gguf_vtype_name(kv->arr_type));
}

static bt_status copy_key(gguf_writer *w, const gguf_kv *kv, const char *key, const char *count_key,
                          int32_t n_layers, const char *name_suffix, int file_type)
{
    if (!strcmp(key, "general.alignment")) return gguf_writer_set_alignment(w, (uint32_t)kv->num.u64);
    if (n_layers > 0 && !strcmp(key, count_key)) return gguf_writer_add_u32(w, key, (uint32_t)n_layers);
    if (file_type >= 0 && !strcmp(key, "general.file_type") && kv->type == GGUF_VT_UINT32)
        return gguf_writer_add_u32(w, key, (uint32_t)file_type);
    switch (kv->type) {
    case GGUF_VT_UINT32: return gguf_writer_add_u32(w, key, (uint32_t)kv->num.u64);
    case GGUF_VT_INT32: return gguf_writer_add_i32(w, key, (int32_t)kv->num.i64);
    case GGUF_VT_UINT64: return gguf_writer_add_u64(w, key, kv->num.u64);
    case GGUF_VT_FLOAT32: return gguf_writer_add_f32(w, key, (float)kv->num.f64);
    case GGUF_VT_BOOL: return gguf_writer_add_bool(w, key, kv->num.u64 != 0);
    case GGUF_VT_STRING: {
        size_t n = (size_t)kv->str.len, extra = strcmp(key, "general.name") ? 0 : strlen(name_suffix);
        char *s = malloc(n + extra + 1);
        if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory copying %s", key);
        memcpy(s, kv->str.ptr, n);
        memcpy(s + n, name_suffix, extra);
        s[n + extra] = 0;
        bt_status st = gguf_writer_add_str(w, key, s);
        free(s);
        return st;
    }
    case GGUF_VT_ARRAY: return copy_array(w, key, kv);
    default:
        return bt_fail(BT_ERR_UNSUPPORTED, "cannot copy key %s of type %s", key, gguf_vtype_name(kv->type));
    }
}

/* 1 when the tensor belongs to a layer at or past n_layers (0: none is dropped). */
static int dropped(const gguf_tensor *t, int32_t n_layers)
{
    if (n_layers <= 0) return 0;
    char name[256];
    gguf_str_copy(t->name, name, sizeof name);
    if (strncmp(name, "blk.", 4)) return 0;
    return atoi(name + 4) >= n_layers;
}

bt_status gguf_rewrite(const char *in_path, const char *out_path, const gguf_rewrite_opts *o)
{
    gguf_file *f = NULL;
    bt_status st = gguf_open(in_path, &f);
    if (st) return st;
    gguf_writer *w = NULL;
    char arch[64], count_key[128], suffix[64];
    gguf_str a;
    uint32_t blocks = 0;
    int32_t n_layers = o->n_layers;
    if (gguf_get_str(f, "general.architecture", &a)) {
        st = bt_fail(BT_ERR_INVALID, "%s has no general.architecture", in_path);
        goto out;
    }
    gguf_str_copy(a, arch, sizeof arch);
    snprintf(count_key, sizeof count_key, "%s.block_count", arch);
    if (gguf_get_u32(f, count_key, &blocks)) {
        st = bt_fail(BT_ERR_INVALID, "%s has no %s", in_path, count_key);
        goto out;
    }
    if (n_layers < 0 || (n_layers > 0 && (uint32_t)n_layers >= blocks)) {
        st = bt_fail(BT_ERR_INVALID, "cannot keep %d layers of %s: it has %u (keep 1..%u)", n_layers, in_path, blocks,
                     blocks - 1);
        goto out;
    }
    if (o->name_suffix)
        snprintf(suffix, sizeof suffix, "%s", o->name_suffix);
    else if (n_layers > 0)
        snprintf(suffix, sizeof suffix, " (layers 0-%d)", n_layers - 1);
    else
        suffix[0] = 0;
    if (!(w = gguf_writer_create())) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory rewriting %s", in_path);
        goto out;
    }
    for (uint64_t i = 0; i < gguf_n_kv(f) && !st; i++) {
        const gguf_kv *kv = gguf_kv_at(f, i);
        char key[256];
        gguf_str_copy(kv->key, key, sizeof key);
        st = copy_key(w, kv, key, count_key, n_layers, suffix, o->file_type);
    }
    for (uint64_t i = 0; i < gguf_n_tensors(f) && !st; i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (dropped(t, n_layers)) continue;
        char name[256];
        gguf_str_copy(t->name, name, sizeof name);
        gguf_tensor_out to = {.type = t->type, .data = t->data, .n_bytes = (size_t)t->n_bytes};
        if (o->tensor && (st = o->tensor(o->ud, t, &to))) break;
        st = gguf_writer_add_tensor(w, name, to.type, t->n_dims, t->ne, to.data, to.n_bytes);
    }
    if (!st) st = gguf_writer_write_file(w, out_path);
out:
    gguf_writer_free(w);
    gguf_close(f);
    return st;
}

bt_status gguf_slice_layers(const char *in_path, const char *out_path, int32_t n_layers)
{
    if (n_layers < 1) return bt_fail(BT_ERR_INVALID, "cannot keep %d layers of %s", n_layers, in_path);
    gguf_rewrite_opts o = {.n_layers = n_layers, .file_type = -1};
    return gguf_rewrite(in_path, out_path, &o);
}
