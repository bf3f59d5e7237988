/* Tensor element types as numbered in GGUF files (ggml's type ids), with their block geometry.
 * A row of n elements of type t occupies n / block_elems * block_bytes bytes; n must be a multiple of block_elems. */
#ifndef BATON_ENGINE_GGML_TYPE_H
#define BATON_ENGINE_GGML_TYPE_H

#include <stdint.h>

typedef enum bt_ggml_type {
    BT_TYPE_F32 = 0,
    BT_TYPE_F16 = 1,
    BT_TYPE_Q4_0 = 2,
    BT_TYPE_Q4_1 = 3,
    BT_TYPE_Q5_0 = 6,
    BT_TYPE_Q5_1 = 7,
    BT_TYPE_Q8_0 = 8,
    BT_TYPE_Q8_1 = 9,
    BT_TYPE_Q2_K = 10,
    BT_TYPE_Q3_K = 11,
    BT_TYPE_Q4_K = 12,
    BT_TYPE_Q5_K = 13,
    BT_TYPE_Q6_K = 14,
    BT_TYPE_Q8_K = 15,
    BT_TYPE_IQ2_XXS = 16,
    BT_TYPE_IQ2_XS = 17,
    BT_TYPE_IQ3_XXS = 18,
    BT_TYPE_IQ1_S = 19,
    BT_TYPE_IQ4_NL = 20,
    BT_TYPE_IQ3_S = 21,
    BT_TYPE_IQ2_S = 22,
    BT_TYPE_IQ4_XS = 23,
    BT_TYPE_I8 = 24,
    BT_TYPE_I16 = 25,
    BT_TYPE_I32 = 26,
    BT_TYPE_I64 = 27,
    BT_TYPE_F64 = 28,
    BT_TYPE_IQ1_M = 29,
    BT_TYPE_BF16 = 30,
    BT_TYPE_TQ1_0 = 34,
    BT_TYPE_TQ2_0 = 35,
    BT_TYPE_COUNT = 36, /* one past the largest id this table knows */
} bt_ggml_type;

typedef struct bt_ggml_type_info {
    const char *name;     /* "Q4_1"; NULL for ids that are unassigned or unknown */
    uint32_t block_elems; /* elements per block (1 for plain types) */
    uint32_t block_bytes; /* bytes per block */
} bt_ggml_type_info;

/* Geometry of type id t, or NULL when t is not a type this table knows. Can't fail. */
const bt_ggml_type_info *bt_ggml_type_get(uint32_t t);

/* Name of t, or "unknown" when the id is not known. */
const char *bt_ggml_type_name(uint32_t t);

/* Type id for a name such as "q4_1" (case-insensitive); -1 when unknown. */
int bt_ggml_type_from_name(const char *name);

#endif
