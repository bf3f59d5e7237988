/* GGUF v2/v3 reader: memory-maps a model file and validates all of it before returning.
 * Every length, count, offset and dimension is checked against the file size with overflow-checked arithmetic;
 * a bad file yields BT_ERR_FORMAT (or BT_ERR_UNSUPPORTED) with one precise message in bt_last_error(), never a crash.
 * Strings returned point into the mapping (not NUL-terminated) and live until gguf_close(). */
#ifndef BATON_ENGINE_GGUF_H
#define BATON_ENGINE_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define GGUF_MAX_DIMS 4
#define GGUF_DEFAULT_ALIGNMENT 32

typedef enum gguf_vtype {
    GGUF_VT_UINT8 = 0,
    GGUF_VT_INT8 = 1,
    GGUF_VT_UINT16 = 2,
    GGUF_VT_INT16 = 3,
    GGUF_VT_UINT32 = 4,
    GGUF_VT_INT32 = 5,
    GGUF_VT_FLOAT32 = 6,
    GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8,
    GGUF_VT_ARRAY = 9,
    GGUF_VT_UINT64 = 10,
    GGUF_VT_INT64 = 11,
    GGUF_VT_FLOAT64 = 12,
    GGUF_VT_COUNT = 13,
} gguf_vtype;

typedef struct gguf_str {
    const char *ptr; /* into the mapping; not NUL-terminated; valid UTF-8 is NOT guaranteed for values */
    uint64_t len;
} gguf_str;

typedef struct gguf_kv {
    gguf_str key;         /* validated: non-empty, valid UTF-8, no NUL */
    gguf_vtype type;
    union {               /* scalar value, widened (type is neither STRING nor ARRAY) */
        uint64_t u64;
        int64_t i64;
        double f64;
    } num;
    gguf_str str;         /* type == STRING */
    gguf_vtype arr_type;  /* type == ARRAY: element type (never ARRAY: nested arrays are refused) */
    uint64_t arr_len;     /* type == ARRAY: element count */
    const uint8_t *arr_data;     /* type == ARRAY: raw little-endian elements (possibly unaligned) in the mapping */
    const uint64_t *arr_str_off; /* type == ARRAY of STRING: offset from arr_data of each element's length prefix */
} gguf_kv;

typedef struct gguf_tensor {
    gguf_str name;               /* validated like keys; unique within the file */
    uint32_t n_dims;             /* 1..GGUF_MAX_DIMS */
    uint64_t ne[GGUF_MAX_DIMS];  /* ne[0] is the innermost (row length); unused dims are 1 */
    uint32_t type;               /* bt_ggml_type */
    uint64_t offset;             /* relative to the data section, aligned */
    uint64_t n_elems;
    uint64_t n_bytes;
    const uint8_t *data;         /* into the mapping; aligned to the file's alignment */
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* Maps and validates the file at path. On success *out owns the mapping (free with gguf_close).
 * Errors: BT_ERR_IO (cannot open/map), BT_ERR_FORMAT (malformed), BT_ERR_UNSUPPORTED (e.g. version 1), BT_ERR_NOMEM. */
bt_status gguf_open(const char *path, gguf_file **out);

/* Same validation over a caller-owned buffer that must outlive the returned handle (tests, fuzzing). */
bt_status gguf_open_memory(const void *data, size_t len, gguf_file **out);

/* Unmaps and frees; NULL is allowed. */
void gguf_close(gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
uint64_t gguf_file_size(const gguf_file *f);
uint32_t gguf_alignment(const gguf_file *f);
uint64_t gguf_data_offset(const gguf_file *f); /* start of the tensor data section in the file */

uint64_t gguf_n_kv(const gguf_file *f);
const gguf_kv *gguf_kv_at(const gguf_file *f, uint64_t i); /* NULL when i is out of range */
const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key); /* NULL when absent */

/* Typed getters. Return BT_ERR_NOT_FOUND when the key is absent (message set), BT_ERR_FORMAT when it has an
 * incompatible type or the value does not fit. Integer getters accept any integer type whose value fits. */
bt_status gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
bt_status gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out);
bt_status gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
bt_status gguf_get_f32(const gguf_file *f, const char *key, float *out);   /* FLOAT32 or FLOAT64 */
bt_status gguf_get_bool(const gguf_file *f, const char *key, int *out);
bt_status gguf_get_str(const gguf_file *f, const char *key, gguf_str *out);
/* Array of the given element type (GGUF_VT_COUNT = any); sets *kv_out to the array's kv. */
bt_status gguf_get_arr(const gguf_file *f, const char *key, gguf_vtype elem_type, const gguf_kv **kv_out);

/* Elements of an array kv; i must be < kv->arr_len (checked: returns an empty string / 0 otherwise). */
gguf_str gguf_arr_str(const gguf_kv *kv, uint64_t i);
int64_t gguf_arr_int(const gguf_kv *kv, uint64_t i);   /* any integer or bool element type */
double gguf_arr_float(const gguf_kv *kv, uint64_t i);  /* FLOAT32/FLOAT64 (integers converted) */

/* Copies a gguf_str into a NUL-terminated buffer of size cap, truncating; returns dst. */
char *gguf_str_copy(gguf_str s, char *dst, size_t cap);
/* 1 when s equals the C string z. */
int gguf_str_eq(gguf_str s, const char *z);

uint64_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, uint64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name); /* NULL when absent */

/* A 64-bit identity of the model in this file: FNV-1a over the header (all metadata and the tensor table) and the
 * first 64 bytes of every tensor. Equal files give equal values on any machine; it is what KV layouts and the
 * router compare (DESIGN 5.1). Can't fail. */
uint64_t gguf_fingerprint(const gguf_file *f);

/* Name of a metadata value type ("uint32", "array", ...). */
const char *gguf_vtype_name(uint32_t t);

#endif
