/* Builds GGUF v3 files in memory: tests use it for tiny random-weight models; quantization will reuse it.
 * Metadata and tensors keep the order they were added in. Every add copies its inputs.
 * All functions return BT_ERR_NOMEM on allocation failure and BT_ERR_INVALID on bad arguments
 * (empty or duplicate names, a row length that is not a multiple of the type's block size). */
#ifndef BATON_ENGINE_GGUF_WRITER_H
#define BATON_ENGINE_GGUF_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct gguf_writer gguf_writer;

/* Returns NULL when out of memory. */
gguf_writer *gguf_writer_create(void);
void gguf_writer_free(gguf_writer *w);

/* Sets general.alignment (power of two); the default is 32 and is not written as a key. */
bt_status gguf_writer_set_alignment(gguf_writer *w, uint32_t alignment);

bt_status gguf_writer_add_u32(gguf_writer *w, const char *key, uint32_t v);
bt_status gguf_writer_add_i32(gguf_writer *w, const char *key, int32_t v);
bt_status gguf_writer_add_u64(gguf_writer *w, const char *key, uint64_t v);
bt_status gguf_writer_add_f32(gguf_writer *w, const char *key, float v);
bt_status gguf_writer_add_bool(gguf_writer *w, const char *key, int v);
bt_status gguf_writer_add_str(gguf_writer *w, const char *key, const char *v);
/* Arrays: n elements copied from v. String elements are NUL-terminated; lens may be NULL (strlen is used). */
bt_status gguf_writer_add_arr_str(gguf_writer *w, const char *key, const char *const *v, const size_t *lens,
                                  uint64_t n);
bt_status gguf_writer_add_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
bt_status gguf_writer_add_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n);

/* Adds a tensor of type `type` (bt_ggml_type) with n_dims dims ne[] (ne[0] innermost); data holds exactly the
 * tensor's byte size (checked against the type's geometry via n_bytes). */
bt_status gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                 const uint64_t *ne, const void *data, size_t n_bytes);

/* Serialises to a malloc'd buffer the caller frees. */
bt_status gguf_writer_to_memory(const gguf_writer *w, uint8_t **out, size_t *out_len);

/* Writes the file atomically (temp file + rename). BT_ERR_IO on failure. */
bt_status gguf_writer_write_file(const gguf_writer *w, const char *path);

#endif
