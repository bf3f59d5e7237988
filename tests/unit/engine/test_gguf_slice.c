/* engine/gguf_slice.c: the first layers of a tiny model as a model of their own: loads, keeps every other tensor
 * and key byte for byte, refuses layer counts it cannot honour. */
#include <string.h>

#include "engine/gguf.h"
#include "engine/gguf_slice.h"
#include "engine/model.h"
#include "test_util.h"
#include "tiny_model.h"

static void test_slice(void)
{
    char in[512], out[512];
    snprintf(in, sizeof in, "%s/slice-in.gguf", test_tmpdir());
    snprintf(out, sizeof out, "%s/slice-out.gguf", test_tmpdir());
    tiny_model_opts o = {0};
    o.n_layer = 3;
    REQUIRE(tiny_model_write(in, &o) == 0);
    REQUIRE(gguf_slice_layers(in, out, 2) == BT_OK);
    bt_model *a = NULL, *b = NULL;
    REQUIRE(bt_model_load(in, &a) == BT_OK);
    REQUIRE(bt_model_load(out, &b) == BT_OK);
    CHECK(a->hp.n_layer == 3 && b->hp.n_layer == 2);
    CHECK(b->hp.n_embd == a->hp.n_embd && b->hp.n_vocab == a->hp.n_vocab && b->hp.n_head_kv == a->hp.n_head_kv);
    CHECK(strstr(b->name, "(layers 0-1)") != NULL);
    gguf_file *f = NULL, *g = NULL;
    REQUIRE(gguf_open(out, &f) == BT_OK);
    REQUIRE(gguf_open(in, &g) == BT_OK);
    CHECK(gguf_find_tensor(f, "blk.2.attn_q.weight") == NULL && gguf_find_tensor(f, "blk.1.attn_q.weight") != NULL);
    /* every kept tensor is the original's bytes; only layer 2's are gone */
    uint64_t in_layer2 = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        char name[256];
        gguf_str_copy(gguf_tensor_at(g, i)->name, name, sizeof name);
        in_layer2 += !strncmp(name, "blk.2.", 6);
    }
    CHECK(in_layer2 > 0 && gguf_n_tensors(g) - gguf_n_tensors(f) == in_layer2);
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        char name[256];
        gguf_str_copy(t->name, name, sizeof name);
        const gguf_tensor *u = gguf_find_tensor(g, name);
        CHECK_MSG(u && u->n_bytes == t->n_bytes && u->type == t->type && !memcmp(u->data, t->data, t->n_bytes),
                  "%s differs", name);
    }
    CHECK(gguf_n_kv(f) == gguf_n_kv(g));
    gguf_close(f);
    gguf_close(g);
    bt_model_free(a);
    bt_model_free(b);
    CHECK(gguf_slice_layers(in, out, 3) == BT_ERR_INVALID && strstr(bt_last_error(), "keep 1..2"));
    CHECK(gguf_slice_layers(in, out, 0) == BT_ERR_INVALID);
    CHECK(gguf_slice_layers("/nonexistent.gguf", out, 1) != BT_OK);
}

int main(void)
{
    RUN(test_slice);
    return test_summary();
}
