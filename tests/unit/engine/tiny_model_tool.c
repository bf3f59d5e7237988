/* Test helper (not a test) for tests/integration/test_logits_oracle.py.
 *   tiny_model_tool PATH TYPE
 *       writes a tiny random-weight llama model (tiny_model.c: 2 layers, d_model 256, 4 query and 2 KV heads,
 *       d_ff 256, vocab 256, untied output) whose embedding, projection and output matrices are all of TYPE
 *       (by name: f32, q4_k, ...), so an oracle can check the forward pass on every weight type the writer makes.
 * Exit status 0 on success, 1 when the file cannot be written, 2 on bad arguments. */
#include <stdio.h>

#include "engine/ggml_type.h"
#include "tiny_model.h"

int main(int argc, char **argv)
{
    int t = argc == 3 ? bt_ggml_type_from_name(argv[2]) : -1;
    if (t < 0) {
        fprintf(stderr, "usage: tiny_model_tool PATH TYPE (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, "
                        "q6_k)\n");
        return 2;
    }
    tiny_model_opts o = {.n_embd = 256, .n_head = 4, .n_head_kv = 2, .n_ff = 256, .matrix_type = (uint32_t)t,
                         .embd_type = (uint32_t)t, .tied = 0, .seed = 7};
    if (tiny_model_write(argv[1], &o) != 0) {
        fprintf(stderr, "tiny_model_tool: cannot write %s\n", argv[1]);
        return 1;
    }
    return 0;
}
