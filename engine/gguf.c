#include "engine/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/ggml_type.h"

/* Names longer than this are refused: real files use < 100 bytes; this bounds hashing and error messages. */
#define GGUF_MAX_NAME_LEN 65535u

struct gguf_file {
    const uint8_t *base; /* [size] the whole file */
    uint64_t size;
    int mapped;          /* 1 when base is our mmap (unmapped in gguf_close) */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_off;
    uint64_t n_kv;
    gguf_kv *kvs;        /* [n_kv] */
    uint64_t n_tensors;
    gguf_tensor *tensors; /* [n_tensors] */
    uint32_t *tensor_hash; /* [tensor_hash_cap] index+1 into tensors, 0 = empty; for gguf_find_tensor */
    uint64_t tensor_hash_cap;
};

typedef struct cursor {
    const uint8_t *base;
    uint64_t size;
    uint64_t off;
} cursor;

static uint64_t remaining(const cursor *c)
{
    return c->size - c->off;
}

static bt_status truncated(const cursor *c, const char *what, uint64_t need)
{
    return bt_fail(BT_ERR_FORMAT, "truncated GGUF: %s needs %" PRIu64 " bytes at offset %" PRIu64
                   " but the file has %" PRIu64 " bytes", what, need, c->off, c->size);
}

static bt_status rd(cursor *c, void *dst, uint64_t n, const char *what)
{
    if (remaining(c) < n) return truncated(c, what, n);
    memcpy(dst, c->base + c->off, n);
    c->off += n;
    return BT_OK;
}

static bt_status rd_u32(cursor *c, uint32_t *v, const char *what)
{
    return rd(c, v, 4, what); /* GGUF is little-endian and so is every host baton supports */
}

static bt_status rd_u64(cursor *c, uint64_t *v, const char *what)
{
    return rd(c, v, 8, what);
}

static int utf8_valid(const uint8_t *s, uint64_t n)
{
    uint64_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        if (b < 0x80) {
            if (b == 0) return 0;
            i++;
            continue;
        }
        uint32_t cp;
        int len;
        if ((b & 0xE0) == 0xC0) { cp = b & 0x1F; len = 2; }
        else if ((b & 0xF0) == 0xE0) { cp = b & 0x0F; len = 3; }
        else if ((b & 0xF8) == 0xF0) { cp = b & 0x07; len = 4; }
        else return 0;
        if (n - i < (uint64_t)len) return 0;
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += (uint64_t)len;
    }
    return 1;
}

/* Reads a length-prefixed string; names (keys, tensor names) must also be short, valid UTF-8 without NUL. */
static bt_status rd_str(cursor *c, gguf_str *s, int is_name, const char *what)
{
    uint64_t len;
    bt_status st = rd_u64(c, &len, what);
    if (st) return st;
    if (len > remaining(c)) {
        return bt_fail(BT_ERR_FORMAT, "GGUF %s at offset %" PRIu64 " claims %" PRIu64
                       " bytes but only %" PRIu64 " remain in the file", what, c->off - 8, len, remaining(c));
    }
    if (is_name) {
        if (len == 0) return bt_fail(BT_ERR_FORMAT, "GGUF %s at offset %" PRIu64 " is empty", what, c->off - 8);
        if (len > GGUF_MAX_NAME_LEN)
            return bt_fail(BT_ERR_FORMAT, "GGUF %s at offset %" PRIu64 " is %" PRIu64 " bytes long (limit %u)", what,
                           c->off - 8, len, GGUF_MAX_NAME_LEN);
        if (!utf8_valid(c->base + c->off, len))
            return bt_fail(BT_ERR_FORMAT, "GGUF %s at offset %" PRIu64 " is not valid UTF-8 (or contains NUL)", what,
                           c->off);
    }
    s->ptr = (const char *)(c->base + c->off);
    s->len = len;
    c->off += len;
    return BT_OK;
}

static uint64_t scalar_size(uint32_t t)
{
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64: return 8;
    default: return 0;
    }
}

const char *gguf_vtype_name(uint32_t t)
{
    static const char *const names[GGUF_VT_COUNT] = {"uint8", "int8", "uint16", "int16", "uint32", "int32",
                                                     "float32", "bool", "string", "array", "uint64", "int64",
                                                     "float64"};
    return t < GGUF_VT_COUNT ? names[t] : "unknown";
}

/* Decodes one little-endian scalar of type t at p into the kv's widened union. */
static void widen_scalar(uint32_t t, const uint8_t *p, gguf_kv *kv)
{
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_BOOL: kv->num.u64 = p[0]; break;
    case GGUF_VT_INT8: kv->num.i64 = (int8_t)p[0]; break;
    case GGUF_VT_UINT16: { uint16_t v; memcpy(&v, p, 2); kv->num.u64 = v; break; }
    case GGUF_VT_INT16: { int16_t v; memcpy(&v, p, 2); kv->num.i64 = v; break; }
    case GGUF_VT_UINT32: { uint32_t v; memcpy(&v, p, 4); kv->num.u64 = v; break; }
    case GGUF_VT_INT32: { int32_t v; memcpy(&v, p, 4); kv->num.i64 = v; break; }
    case GGUF_VT_FLOAT32: { float v; memcpy(&v, p, 4); kv->num.f64 = v; break; }
    case GGUF_VT_UINT64: { uint64_t v; memcpy(&v, p, 8); kv->num.u64 = v; break; }
    case GGUF_VT_INT64: { int64_t v; memcpy(&v, p, 8); kv->num.i64 = v; break; }
    case GGUF_VT_FLOAT64: { double v; memcpy(&v, p, 8); kv->num.f64 = v; break; }
    default: break;
    }
}

static uint64_t hash_bytes(const char *p, uint64_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 1099511628211ull;
    return h;
}

static int str_eq(gguf_str a, gguf_str b)
{
    return a.len == b.len && memcmp(a.ptr, b.ptr, a.len) == 0;
}

/* Open-addressing index of names (slot = index + 1). Returns the existing index on a duplicate, else -1. */
static int64_t name_index_insert(uint32_t *slots, uint64_t cap, const gguf_str *names, size_t stride, uint32_t idx)
{
    const gguf_str *name = (const gguf_str *)((const char *)names + stride * idx);
    uint64_t h = hash_bytes(name->ptr, name->len) & (cap - 1);
    while (slots[h]) {
        uint32_t other = slots[h] - 1;
        const gguf_str *o = (const gguf_str *)((const char *)names + stride * other);
        if (str_eq(*o, *name)) return other;
        h = (h + 1) & (cap - 1);
    }
    slots[h] = idx + 1;
    return -1;
}

static uint64_t pow2_at_least(uint64_t n)
{
    uint64_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static bt_status parse_kv(cursor *c, uint64_t i, gguf_kv *kv)
{
    char what[200];
    snprintf(what, sizeof what, "key %" PRIu64, i);
    bt_status st = rd_str(c, &kv->key, 1, what);
    if (st) return st;
    char key[80];
    gguf_str_copy(kv->key, key, sizeof key);
    uint32_t t;
    snprintf(what, sizeof what, "type of key '%s'", key);
    if ((st = rd_u32(c, &t, what))) return st;
    if (t >= GGUF_VT_COUNT)
        return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' has unknown value type %u", key, t);
    kv->type = (gguf_vtype)t;
    snprintf(what, sizeof what, "value of key '%s'", key);
    if (t == GGUF_VT_STRING) return rd_str(c, &kv->str, 0, what);
    if (t != GGUF_VT_ARRAY) {
        uint64_t sz = scalar_size(t);
        if (remaining(c) < sz) return truncated(c, what, sz);
        if (t == GGUF_VT_BOOL && c->base[c->off] > 1)
            return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' is a bool with value %u", key, c->base[c->off]);
        widen_scalar(t, c->base + c->off, kv);
        c->off += sz;
        return BT_OK;
    }
    uint32_t et;
    snprintf(what, sizeof what, "array header of key '%s'", key);
    if ((st = rd_u32(c, &et, what))) return st;
    if ((st = rd_u64(c, &kv->arr_len, what))) return st;
    if (et >= GGUF_VT_COUNT) return bt_fail(BT_ERR_FORMAT, "GGUF array '%s' has unknown element type %u", key, et);
    if (et == GGUF_VT_ARRAY) return bt_fail(BT_ERR_FORMAT, "GGUF array '%s' nests arrays (not supported)", key);
    kv->arr_type = (gguf_vtype)et;
    if (et == GGUF_VT_STRING) {
        /* Each element costs at least its 8-byte length prefix: bounds the count before any allocation. */
        if (kv->arr_len > remaining(c) / 8)
            return bt_fail(BT_ERR_FORMAT, "GGUF string array '%s' claims %" PRIu64 " elements but only %" PRIu64
                           " bytes remain", key, kv->arr_len, remaining(c));
        uint64_t *offs = malloc(kv->arr_len ? kv->arr_len * sizeof *offs : 1);
        if (!offs) return bt_fail(BT_ERR_NOMEM, "out of memory for GGUF string array '%s'", key);
        kv->arr_data = c->base + c->off;
        for (uint64_t k = 0; k < kv->arr_len; k++) {
            offs[k] = (uint64_t)(c->base + c->off - kv->arr_data);
            gguf_str s;
            snprintf(what, sizeof what, "element %" PRIu64 " of array '%s'", k, key);
            if ((st = rd_str(c, &s, 0, what))) {
                free(offs);
                return st;
            }
        }
        kv->arr_str_off = offs;
        return BT_OK;
    }
    uint64_t esz = scalar_size(et);
    if (kv->arr_len > remaining(c) / esz)
        return bt_fail(BT_ERR_FORMAT, "GGUF array '%s' claims %" PRIu64 " %s elements but only %" PRIu64
                       " bytes remain", key, kv->arr_len, gguf_vtype_name(et), remaining(c));
    kv->arr_data = c->base + c->off;
    c->off += kv->arr_len * esz;
    return BT_OK;
}

static bt_status parse_tensor(cursor *c, uint64_t i, gguf_tensor *t)
{
    char what[200];
    snprintf(what, sizeof what, "name of tensor %" PRIu64, i);
    bt_status st = rd_str(c, &t->name, 1, what);
    if (st) return st;
    char name[80];
    gguf_str_copy(t->name, name, sizeof name);
    snprintf(what, sizeof what, "info of tensor '%s'", name);
    if ((st = rd_u32(c, &t->n_dims, what))) return st;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s' has %u dimensions (1..%d allowed)", name, t->n_dims,
                       GGUF_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims) continue;
        if ((st = rd_u64(c, &t->ne[d], what))) return st;
        if (t->ne[d] == 0 || t->ne[d] > (uint64_t)INT64_MAX)
            return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s' has invalid dimension %u = %" PRIu64, name, d, t->ne[d]);
        if (__builtin_mul_overflow(n, t->ne[d], &n) || n > (uint64_t)INT64_MAX)
            return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s': the product of its dimensions overflows", name);
    }
    t->n_elems = n;
    if ((st = rd_u32(c, &t->type, what))) return st;
    const bt_ggml_type_info *ti = bt_ggml_type_get(t->type);
    if (!ti) return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s' has unknown type id %u", name, t->type);
    if (t->ne[0] % ti->block_elems)
        return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s': row length %" PRIu64 " is not a multiple of the %s block size %u",
                       name, t->ne[0], ti->name, ti->block_elems);
    if (__builtin_mul_overflow(n / ti->block_elems, (uint64_t)ti->block_bytes, &t->n_bytes))
        return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s': byte size overflows", name);
    return rd_u64(c, &t->offset, what);
}

static bt_status parse(gguf_file *f)
{
    cursor c = {f->base, f->size, 0};
    bt_status st;
    if (f->size < 4 || memcmp(f->base, "GGUF", 4) != 0)
        return bt_fail(BT_ERR_FORMAT, "not a GGUF file (bad magic; expected 'GGUF')");
    c.off = 4;
    if ((st = rd_u32(&c, &f->version, "version"))) return st;
    if (f->version == 1)
        return bt_fail(BT_ERR_UNSUPPORTED, "GGUF version 1 is not supported (re-convert the model to v3)");
    if (f->version == 0x02000000u || f->version == 0x03000000u)
        return bt_fail(BT_ERR_UNSUPPORTED, "big-endian GGUF files are not supported");
    if (f->version != 2 && f->version != 3)
        return bt_fail(BT_ERR_UNSUPPORTED, "unsupported GGUF version %u (2 and 3 are supported)", f->version);
    if ((st = rd_u64(&c, &f->n_tensors, "tensor count"))) return st;
    if ((st = rd_u64(&c, &f->n_kv, "metadata count"))) return st;
    /* Minimum encoded sizes (key/name of 1 byte): kv >= 8+1+4+1, tensor info >= 8+1+4+8+4+8. */
    if (f->n_kv > remaining(&c) / 14)
        return bt_fail(BT_ERR_FORMAT, "GGUF claims %" PRIu64 " metadata entries, more than the file can hold", f->n_kv);
    if (f->n_tensors > remaining(&c) / 33 || f->n_tensors > UINT32_MAX - 1)
        return bt_fail(BT_ERR_FORMAT, "GGUF claims %" PRIu64 " tensors, more than the file can hold", f->n_tensors);

    f->kvs = calloc(f->n_kv ? f->n_kv : 1, sizeof *f->kvs);
    if (!f->kvs) return bt_fail(BT_ERR_NOMEM, "out of memory for %" PRIu64 " GGUF metadata entries", f->n_kv);
    uint64_t key_cap = pow2_at_least(f->n_kv * 2);
    uint32_t *key_slots = calloc(key_cap, sizeof *key_slots);
    if (!key_slots) return bt_fail(BT_ERR_NOMEM, "out of memory for the GGUF key index");
    st = BT_OK;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        gguf_kv *kv = &f->kvs[i];
        if ((st = parse_kv(&c, i, kv))) break;
        int64_t dup = name_index_insert(key_slots, key_cap, &f->kvs[0].key, sizeof(gguf_kv), (uint32_t)i);
        if (dup >= 0) {
            char key[80];
            st = bt_fail(BT_ERR_FORMAT, "GGUF key '%s' appears twice (entries %" PRId64 " and %" PRIu64 ")",
                         gguf_str_copy(kv->key, key, sizeof key), dup, i);
            break;
        }
    }
    free(key_slots);
    if (st) return st;

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *al = gguf_find_kv(f, "general.alignment");
    if (al) {
        if (al->type != GGUF_VT_UINT32 || al->num.u64 == 0 || (al->num.u64 & (al->num.u64 - 1)) ||
            al->num.u64 > (1u << 20))
            return bt_fail(BT_ERR_FORMAT, "GGUF general.alignment must be a uint32 power of two up to 1 MiB");
        f->alignment = (uint32_t)al->num.u64;
    }

    f->tensors = calloc(f->n_tensors ? f->n_tensors : 1, sizeof *f->tensors);
    if (!f->tensors) return bt_fail(BT_ERR_NOMEM, "out of memory for %" PRIu64 " GGUF tensors", f->n_tensors);
    f->tensor_hash_cap = pow2_at_least(f->n_tensors * 2);
    f->tensor_hash = calloc(f->tensor_hash_cap, sizeof *f->tensor_hash);
    if (!f->tensor_hash) return bt_fail(BT_ERR_NOMEM, "out of memory for the GGUF tensor index");
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        if ((st = parse_tensor(&c, i, &f->tensors[i]))) return st;
        int64_t dup = name_index_insert(f->tensor_hash, f->tensor_hash_cap, &f->tensors[0].name, sizeof(gguf_tensor),
                                        (uint32_t)i);
        if (dup >= 0) {
            char name[80];
            return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s' appears twice",
                           gguf_str_copy(f->tensors[i].name, name, sizeof name));
        }
    }

    uint64_t data_off = c.off;
    uint64_t pad = (f->alignment - data_off % f->alignment) % f->alignment;
    data_off += pad;
    f->data_off = data_off;
    if (f->n_tensors && data_off > f->size)
        return bt_fail(BT_ERR_FORMAT, "truncated GGUF: the tensor data section would start at %" PRIu64
                       " beyond the end of the file (%" PRIu64 " bytes)", data_off, f->size);
    uint64_t data_size = data_off <= f->size ? f->size - data_off : 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        char name[80];
        gguf_str_copy(t->name, name, sizeof name);
        if (t->offset % f->alignment)
            return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s' has offset %" PRIu64 ", not a multiple of the alignment %u",
                           name, t->offset, f->alignment);
        if (t->offset > data_size || t->n_bytes > data_size - t->offset)
            return bt_fail(BT_ERR_FORMAT, "GGUF tensor '%s' (%" PRIu64 " bytes at data offset %" PRIu64
                           ") extends past the end of the file (data section is %" PRIu64 " bytes): truncated file?",
                           name, t->n_bytes, t->offset, data_size);
        t->data = f->base + data_off + t->offset;
    }
    return BT_OK;
}

static bt_status open_common(const uint8_t *base, uint64_t size, int mapped, gguf_file **out)
{
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return bt_fail(BT_ERR_NOMEM, "out of memory opening a GGUF file");
    f->base = base;
    f->size = size;
    f->mapped = mapped;
    bt_status st = parse(f);
    if (st) {
        gguf_close(f);
        return st;
    }
    *out = f;
    return BT_OK;
}

bt_status gguf_open_memory(const void *data, size_t len, gguf_file **out)
{
    return open_common(data, len, 0, out);
}

bt_status gguf_open(const char *path, gguf_file **out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return bt_fail(BT_ERR_IO, "cannot open model file '%s': %s", path, strerror(errno));
    struct stat sb;
    bt_status st;
    if (fstat(fd, &sb) != 0) {
        st = bt_fail(BT_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
        goto out_close;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = bt_fail(BT_ERR_IO, "'%s' is not a regular file", path);
        goto out_close;
    }
    if (sb.st_size == 0) {
        st = bt_fail(BT_ERR_FORMAT, "'%s' is empty, not a GGUF file", path);
        goto out_close;
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        st = bt_fail(BT_ERR_IO, "cannot map '%s': %s", path, strerror(errno));
        goto out_close;
    }
    st = open_common(m, (uint64_t)sb.st_size, 1, out);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        bt_fail(st, "%s: %s", path, msg);
    }
out_close:
    close(fd);
    return st;
}

void gguf_close(gguf_file *f)
{
    if (!f) return;
    if (f->kvs) {
        for (uint64_t i = 0; i < f->n_kv; i++) free((void *)f->kvs[i].arr_str_off);
        free(f->kvs);
    }
    free(f->tensors);
    free(f->tensor_hash);
    if (f->mapped) munmap((void *)f->base, f->size);
    free(f);
}

uint32_t gguf_version(const gguf_file *f) { return f->version; }
uint64_t gguf_file_size(const gguf_file *f) { return f->size; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
uint64_t gguf_data_offset(const gguf_file *f) { return f->data_off; }
uint64_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }
uint64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }

const gguf_kv *gguf_kv_at(const gguf_file *f, uint64_t i)
{
    return i < f->n_kv ? &f->kvs[i] : NULL;
}

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key)
{
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (f->kvs[i].key.ptr && gguf_str_eq(f->kvs[i].key, key)) return &f->kvs[i];
    return NULL;
}

const gguf_tensor *gguf_tensor_at(const gguf_file *f, uint64_t i)
{
    return i < f->n_tensors ? &f->tensors[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (!f->tensor_hash_cap) return NULL;
    uint64_t n = strlen(name);
    uint64_t h = hash_bytes(name, n) & (f->tensor_hash_cap - 1);
    while (f->tensor_hash[h]) {
        const gguf_tensor *t = &f->tensors[f->tensor_hash[h] - 1];
        if (t->name.len == n && memcmp(t->name.ptr, name, n) == 0) return t;
        h = (h + 1) & (f->tensor_hash_cap - 1);
    }
    return NULL;
}

static bt_status find_typed(const gguf_file *f, const char *key, const gguf_kv **kv)
{
    *kv = gguf_find_kv(f, key);
    if (!*kv) return bt_fail(BT_ERR_NOT_FOUND, "GGUF metadata key '%s' is missing", key);
    return BT_OK;
}

static int is_unsigned(gguf_vtype t)
{
    return t == GGUF_VT_UINT8 || t == GGUF_VT_UINT16 || t == GGUF_VT_UINT32 || t == GGUF_VT_UINT64 ||
           t == GGUF_VT_BOOL;
}

static int is_signed(gguf_vtype t)
{
    return t == GGUF_VT_INT8 || t == GGUF_VT_INT16 || t == GGUF_VT_INT32 || t == GGUF_VT_INT64;
}

bt_status gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out)
{
    const gguf_kv *kv;
    bt_status st = find_typed(f, key, &kv);
    if (st) return st;
    if (is_unsigned(kv->type) && kv->type != GGUF_VT_BOOL) {
        *out = kv->num.u64;
        return BT_OK;
    }
    if (is_signed(kv->type) && kv->num.i64 >= 0) {
        *out = (uint64_t)kv->num.i64;
        return BT_OK;
    }
    return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' should be a non-negative integer but is a %s", key,
                   gguf_vtype_name(kv->type));
}

bt_status gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out)
{
    uint64_t v;
    bt_status st = gguf_get_u64(f, key, &v);
    if (st) return st;
    if (v > UINT32_MAX) return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' = %" PRIu64 " does not fit in 32 bits", key, v);
    *out = (uint32_t)v;
    return BT_OK;
}

bt_status gguf_get_i64(const gguf_file *f, const char *key, int64_t *out)
{
    const gguf_kv *kv;
    bt_status st = find_typed(f, key, &kv);
    if (st) return st;
    if (is_signed(kv->type)) {
        *out = kv->num.i64;
        return BT_OK;
    }
    if (is_unsigned(kv->type) && kv->type != GGUF_VT_BOOL && kv->num.u64 <= (uint64_t)INT64_MAX) {
        *out = (int64_t)kv->num.u64;
        return BT_OK;
    }
    return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' should be an integer but is a %s", key, gguf_vtype_name(kv->type));
}

bt_status gguf_get_f32(const gguf_file *f, const char *key, float *out)
{
    const gguf_kv *kv;
    bt_status st = find_typed(f, key, &kv);
    if (st) return st;
    if (kv->type != GGUF_VT_FLOAT32 && kv->type != GGUF_VT_FLOAT64)
        return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' should be a float but is a %s", key, gguf_vtype_name(kv->type));
    *out = (float)kv->num.f64;
    return BT_OK;
}

bt_status gguf_get_bool(const gguf_file *f, const char *key, int *out)
{
    const gguf_kv *kv;
    bt_status st = find_typed(f, key, &kv);
    if (st) return st;
    if (kv->type != GGUF_VT_BOOL)
        return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' should be a bool but is a %s", key, gguf_vtype_name(kv->type));
    *out = kv->num.u64 != 0;
    return BT_OK;
}

bt_status gguf_get_str(const gguf_file *f, const char *key, gguf_str *out)
{
    const gguf_kv *kv;
    bt_status st = find_typed(f, key, &kv);
    if (st) return st;
    if (kv->type != GGUF_VT_STRING)
        return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' should be a string but is a %s", key, gguf_vtype_name(kv->type));
    *out = kv->str;
    return BT_OK;
}

bt_status gguf_get_arr(const gguf_file *f, const char *key, gguf_vtype elem_type, const gguf_kv **kv_out)
{
    const gguf_kv *kv;
    bt_status st = find_typed(f, key, &kv);
    if (st) return st;
    if (kv->type != GGUF_VT_ARRAY)
        return bt_fail(BT_ERR_FORMAT, "GGUF key '%s' should be an array but is a %s", key, gguf_vtype_name(kv->type));
    if (elem_type != GGUF_VT_COUNT && kv->arr_type != elem_type)
        return bt_fail(BT_ERR_FORMAT, "GGUF array '%s' should hold %s elements but holds %s", key,
                       gguf_vtype_name(elem_type), gguf_vtype_name(kv->arr_type));
    *kv_out = kv;
    return BT_OK;
}

gguf_str gguf_arr_str(const gguf_kv *kv, uint64_t i)
{
    gguf_str s = {"", 0};
    if (kv->type != GGUF_VT_ARRAY || kv->arr_type != GGUF_VT_STRING || i >= kv->arr_len) return s;
    /* Offsets were validated at open: each points at a length prefix followed by that many bytes. */
    const uint8_t *p = kv->arr_data + kv->arr_str_off[i];
    memcpy(&s.len, p, 8);
    s.ptr = (const char *)(p + 8);
    return s;
}

int64_t gguf_arr_int(const gguf_kv *kv, uint64_t i)
{
    if (kv->type != GGUF_VT_ARRAY || i >= kv->arr_len || !scalar_size(kv->arr_type)) return 0;
    uint64_t esz = scalar_size(kv->arr_type);
    gguf_kv tmp = {0};
    widen_scalar(kv->arr_type, kv->arr_data + i * esz, &tmp);
    if (is_signed(kv->arr_type)) return tmp.num.i64;
    if (is_unsigned(kv->arr_type)) return (int64_t)tmp.num.u64;
    return (int64_t)tmp.num.f64;
}

double gguf_arr_float(const gguf_kv *kv, uint64_t i)
{
    if (kv->type != GGUF_VT_ARRAY || i >= kv->arr_len || !scalar_size(kv->arr_type)) return 0;
    uint64_t esz = scalar_size(kv->arr_type);
    gguf_kv tmp = {0};
    widen_scalar(kv->arr_type, kv->arr_data + i * esz, &tmp);
    if (kv->arr_type == GGUF_VT_FLOAT32 || kv->arr_type == GGUF_VT_FLOAT64) return tmp.num.f64;
    if (is_signed(kv->arr_type)) return (double)tmp.num.i64;
    return (double)tmp.num.u64;
}

uint64_t gguf_fingerprint(const gguf_file *f)
{
    uint64_t h = 1469598103934665603ull;
    uint64_t head = f->data_off < f->size ? f->data_off : f->size;
    for (uint64_t i = 0; i < head; i++) h = (h ^ f->base[i]) * 1099511628211ull;
    for (uint64_t t = 0; t < f->n_tensors; t++) {
        const gguf_tensor *ts = &f->tensors[t];
        uint64_t n = ts->n_bytes < 64 ? ts->n_bytes : 64;
        for (uint64_t i = 0; i < n; i++) h = (h ^ ts->data[i]) * 1099511628211ull;
    }
    return h;
}

char *gguf_str_copy(gguf_str s, char *dst, size_t cap)
{
    if (!cap) return dst;
    size_t n = s.len < cap - 1 ? (size_t)s.len : cap - 1;
    if (n) memcpy(dst, s.ptr, n);
    dst[n] = '\0';
    return dst;
}

int gguf_str_eq(gguf_str s, const char *z)
{
    size_t n = strlen(z);
    return s.len == n && (n == 0 || memcmp(s.ptr, z, n) == 0);
}
