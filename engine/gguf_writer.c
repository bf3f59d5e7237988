#include "engine/gguf_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/ggml_type.h"
#include "engine/gguf.h"

typedef struct buf {
    uint8_t *p;
    size_t len, cap;
} buf;

typedef struct wtensor {
    char *name;
    uint32_t type, n_dims;
    uint64_t ne[GGUF_MAX_DIMS];
    uint8_t *data;
    size_t n_bytes;
} wtensor;

struct gguf_writer {
    buf kv;           /* encoded metadata entries, in order */
    uint64_t n_kv;
    char **keys;      /* [n_kv] for duplicate checks */
    wtensor *tensors; /* [n_tensors] */
    uint64_t n_tensors;
    uint32_t alignment;
};

static int buf_put(buf *b, const void *p, size_t n)
{
    if (b->cap - b->len < n) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->len < n) cap *= 2;
        uint8_t *np = realloc(b->p, cap);
        if (!np) return -1;
        b->p = np;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, p, n);
    b->len += n;
    return 0;
}

static int buf_u32(buf *b, uint32_t v) { return buf_put(b, &v, 4); }
static int buf_u64(buf *b, uint64_t v) { return buf_put(b, &v, 8); }
static int buf_str(buf *b, const char *s, size_t n) { return buf_u64(b, n) || buf_put(b, s, n); }

gguf_writer *gguf_writer_create(void)
{
    gguf_writer *w = calloc(1, sizeof *w);
    if (w) w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void gguf_writer_free(gguf_writer *w)
{
    if (!w) return;
    for (uint64_t i = 0; i < w->n_kv; i++) free(w->keys[i]);
    free(w->keys);
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w->kv.p);
    free(w);
}

/* Registers key and writes its name and value type; the caller appends the value. */
static bt_status begin_kv(gguf_writer *w, const char *key, uint32_t vtype)
{
    if (!key || !*key) return bt_fail(BT_ERR_INVALID, "gguf writer: empty key");
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->keys[i], key)) return bt_fail(BT_ERR_INVALID, "gguf writer: duplicate key '%s'", key);
    char **keys = realloc(w->keys, (w->n_kv + 1) * sizeof *keys);
    if (!keys) return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    w->keys = keys;
    if (!(keys[w->n_kv] = strdup(key))) return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    w->n_kv++;
    if (buf_str(&w->kv, key, strlen(key)) || buf_u32(&w->kv, vtype))
        return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    return BT_OK;
}

static bt_status add_scalar(gguf_writer *w, const char *key, uint32_t vtype, const void *v, size_t n)
{
    bt_status st = begin_kv(w, key, vtype);
    if (st) return st;
    return buf_put(&w->kv, v, n) ? bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory") : BT_OK;
}

bt_status gguf_writer_set_alignment(gguf_writer *w, uint32_t alignment)
{
    if (!alignment || (alignment & (alignment - 1)))
        return bt_fail(BT_ERR_INVALID, "gguf writer: alignment %u is not a power of two", alignment);
    bt_status st = gguf_writer_add_u32(w, "general.alignment", alignment);
    if (st == BT_OK) w->alignment = alignment;
    return st;
}

bt_status gguf_writer_add_u32(gguf_writer *w, const char *key, uint32_t v) { return add_scalar(w, key, GGUF_VT_UINT32, &v, 4); }
bt_status gguf_writer_add_i32(gguf_writer *w, const char *key, int32_t v) { return add_scalar(w, key, GGUF_VT_INT32, &v, 4); }
bt_status gguf_writer_add_u64(gguf_writer *w, const char *key, uint64_t v) { return add_scalar(w, key, GGUF_VT_UINT64, &v, 8); }
bt_status gguf_writer_add_f32(gguf_writer *w, const char *key, float v) { return add_scalar(w, key, GGUF_VT_FLOAT32, &v, 4); }

bt_status gguf_writer_add_bool(gguf_writer *w, const char *key, int v)
{
    uint8_t b = v ? 1 : 0;
    return add_scalar(w, key, GGUF_VT_BOOL, &b, 1);
}

bt_status gguf_writer_add_str(gguf_writer *w, const char *key, const char *v)
{
    bt_status st = begin_kv(w, key, GGUF_VT_STRING);
    if (st) return st;
    return buf_str(&w->kv, v, strlen(v)) ? bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory") : BT_OK;
}

static bt_status add_array(gguf_writer *w, const char *key, uint32_t etype, const void *v, size_t esz, uint64_t n)
{
    bt_status st = begin_kv(w, key, GGUF_VT_ARRAY);
    if (st) return st;
    if (buf_u32(&w->kv, etype) || buf_u64(&w->kv, n) || buf_put(&w->kv, v, (size_t)(esz * n)))
        return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    return BT_OK;
}

bt_status gguf_writer_add_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n)
{
    return add_array(w, key, GGUF_VT_INT32, v, 4, n);
}

bt_status gguf_writer_add_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n)
{
    return add_array(w, key, GGUF_VT_FLOAT32, v, 4, n);
}

bt_status gguf_writer_add_arr_str(gguf_writer *w, const char *key, const char *const *v, const size_t *lens,
                                  uint64_t n)
{
    bt_status st = add_array(w, key, GGUF_VT_STRING, NULL, 0, n);
    if (st) return st;
    for (uint64_t i = 0; i < n; i++)
        if (buf_str(&w->kv, v[i], lens ? lens[i] : strlen(v[i])))
            return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    return BT_OK;
}

bt_status gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                 const uint64_t *ne, const void *data, size_t n_bytes)
{
    if (!name || !*name) return bt_fail(BT_ERR_INVALID, "gguf writer: empty tensor name");
    const bt_ggml_type_info *ti = bt_ggml_type_get(type);
    if (!ti) return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s' has unknown type %u", name, type);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s' has %u dims", name, n_dims);
    uint64_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (!ne[d] || __builtin_mul_overflow(n, ne[d], &n))
            return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s' has a bad shape", name);
    }
    if (ne[0] % ti->block_elems)
        return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s' row length %llu is not a multiple of %u", name,
                       (unsigned long long)ne[0], ti->block_elems);
    if (n / ti->block_elems * ti->block_bytes != n_bytes)
        return bt_fail(BT_ERR_INVALID, "gguf writer: tensor '%s' needs %llu bytes, got %zu", name,
                       (unsigned long long)(n / ti->block_elems * ti->block_bytes), n_bytes);
    for (uint64_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name))
            return bt_fail(BT_ERR_INVALID, "gguf writer: duplicate tensor '%s'", name);
    wtensor *ts = realloc(w->tensors, (w->n_tensors + 1) * sizeof *ts);
    if (!ts) return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    w->tensors = ts;
    wtensor *t = &ts[w->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    t->data = malloc(n_bytes ? n_bytes : 1);
    if (!t->name || !t->data) {
        free(t->name);
        free(t->data);
        return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory");
    }
    if (n_bytes) memcpy(t->data, data, n_bytes);
    t->type = type;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->n_bytes = n_bytes;
    w->n_tensors++;
    return BT_OK;
}

static size_t align_up(size_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

bt_status gguf_writer_to_memory(const gguf_writer *w, uint8_t **out, size_t *out_len)
{
    buf b = {0};
    int err = buf_put(&b, "GGUF", 4) || buf_u32(&b, 3) || buf_u64(&b, w->n_tensors) || buf_u64(&b, w->n_kv) ||
              buf_put(&b, w->kv.p, w->kv.len);
    size_t off = 0;
    for (uint64_t i = 0; i < w->n_tensors && !err; i++) {
        const wtensor *t = &w->tensors[i];
        err = buf_str(&b, t->name, strlen(t->name)) || buf_u32(&b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims && !err; d++) err = buf_u64(&b, t->ne[d]);
        err = err || buf_u32(&b, t->type) || buf_u64(&b, off);
        off = align_up(off + t->n_bytes, w->alignment);
    }
    static const uint8_t zeros[64];
    while (!err && b.len % w->alignment) err = buf_put(&b, zeros, 1);
    for (uint64_t i = 0; i < w->n_tensors && !err; i++) {
        const wtensor *t = &w->tensors[i];
        err = buf_put(&b, t->data, t->n_bytes);
        while (!err && (b.len % w->alignment) && i + 1 < w->n_tensors) err = buf_put(&b, zeros, 1);
    }
    if (err) {
        free(b.p);
        return bt_fail(BT_ERR_NOMEM, "gguf writer: out of memory serialising");
    }
    *out = b.p;
    *out_len = b.len;
    return BT_OK;
}

bt_status gguf_writer_write_file(const gguf_writer *w, const char *path)
{
    uint8_t *data;
    size_t len;
    bt_status st = gguf_writer_to_memory(w, &data, &len);
    if (st) return st;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        st = bt_fail(BT_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
        goto out;
    }
    size_t n = fwrite(data, 1, len, f);
    if (fclose(f) != 0 || n != len) {
        st = bt_fail(BT_ERR_IO, "cannot write '%s': %s", tmp, strerror(errno));
        unlink(tmp);
        goto out;
    }
    if (rename(tmp, path) != 0) {
        st = bt_fail(BT_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
        unlink(tmp);
    }
out:
    free(data);
    return st;
}
