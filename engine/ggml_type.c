#include "engine/ggml_type.h"

#include <stddef.h>
#include <strings.h>

/* Block sizes as defined by the GGUF/ggml formats (cross-checked against gguf-py's GGML_QUANT_SIZES in tests). */
static const bt_ggml_type_info type_table[BT_TYPE_COUNT] = {
    [BT_TYPE_F32] = {"F32", 1, 4},
    [BT_TYPE_F16] = {"F16", 1, 2},
    [BT_TYPE_Q4_0] = {"Q4_0", 32, 18},
    [BT_TYPE_Q4_1] = {"Q4_1", 32, 20},
    [BT_TYPE_Q5_0] = {"Q5_0", 32, 22},
    [BT_TYPE_Q5_1] = {"Q5_1", 32, 24},
    [BT_TYPE_Q8_0] = {"Q8_0", 32, 34},
    [BT_TYPE_Q8_1] = {"Q8_1", 32, 36},
    [BT_TYPE_Q2_K] = {"Q2_K", 256, 84},
    [BT_TYPE_Q3_K] = {"Q3_K", 256, 110},
    [BT_TYPE_Q4_K] = {"Q4_K", 256, 144},
    [BT_TYPE_Q5_K] = {"Q5_K", 256, 176},
    [BT_TYPE_Q6_K] = {"Q6_K", 256, 210},
    [BT_TYPE_Q8_K] = {"Q8_K", 256, 292},
    [BT_TYPE_IQ2_XXS] = {"IQ2_XXS", 256, 66},
    [BT_TYPE_IQ2_XS] = {"IQ2_XS", 256, 74},
    [BT_TYPE_IQ3_XXS] = {"IQ3_XXS", 256, 98},
    [BT_TYPE_IQ1_S] = {"IQ1_S", 256, 50},
    [BT_TYPE_IQ4_NL] = {"IQ4_NL", 32, 18},
    [BT_TYPE_IQ3_S] = {"IQ3_S", 256, 110},
    [BT_TYPE_IQ2_S] = {"IQ2_S", 256, 82},
    [BT_TYPE_IQ4_XS] = {"IQ4_XS", 256, 136},
    [BT_TYPE_I8] = {"I8", 1, 1},
    [BT_TYPE_I16] = {"I16", 1, 2},
    [BT_TYPE_I32] = {"I32", 1, 4},
    [BT_TYPE_I64] = {"I64", 1, 8},
    [BT_TYPE_F64] = {"F64", 1, 8},
    [BT_TYPE_IQ1_M] = {"IQ1_M", 256, 56},
    [BT_TYPE_BF16] = {"BF16", 1, 2},
    [BT_TYPE_TQ1_0] = {"TQ1_0", 256, 54},
    [BT_TYPE_TQ2_0] = {"TQ2_0", 256, 66},
};

const bt_ggml_type_info *bt_ggml_type_get(uint32_t t)
{
    if (t >= BT_TYPE_COUNT || !type_table[t].name) return NULL;
    return &type_table[t];
}

const char *bt_ggml_type_name(uint32_t t)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    return ti ? ti->name : "unknown";
}

int bt_ggml_type_from_name(const char *name)
{
    for (int t = 0; t < BT_TYPE_COUNT; t++)
        if (type_table[t].name && !strcasecmp(type_table[t].name, name)) return t;
    return -1;
}
