/* libFuzzer target: the GGUF reader over arbitrary bytes, then every accessor over what it accepted. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* An exact-size copy so reads past the end are caught by ASan. */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    gguf_file *f = NULL;
    if (gguf_open_memory(copy, size, &f) == BT_OK) {
        volatile uint64_t sink = 0;
        for (uint64_t i = 0; i < gguf_n_kv(f); i++) {
            const gguf_kv *kv = gguf_kv_at(f, i);
            if (kv->type == GGUF_VT_ARRAY) {
                for (uint64_t k = 0; k < kv->arr_len && k < 64; k++) {
                    if (kv->arr_type == GGUF_VT_STRING) sink += gguf_arr_str(kv, k).len;
                    else sink += (uint64_t)gguf_arr_int(kv, k);
                }
            }
        }
        for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
            const gguf_tensor *t = gguf_tensor_at(f, i);
            if (t->n_bytes) sink += t->data[0] + t->data[t->n_bytes - 1];
            char name[128];
            gguf_str_copy(t->name, name, sizeof name);
            sink += gguf_find_tensor(f, name) != NULL;
        }
        uint32_t u;
        gguf_str s;
        sink += gguf_get_u32(f, "general.alignment", &u) == BT_OK;
        sink += gguf_get_str(f, "general.architecture", &s) == BT_OK;
        (void)sink;
        gguf_close(f);
    }
    free(copy);
    return 0;
}
