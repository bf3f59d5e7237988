/* The served model for the router fuzzers: the default model's tokenizer and chat template (real special tokens,
 * the ChatML markers that issue 16.7 is about), loaded once. BATON_MODEL overrides the cached default. The model is
 * what `make test` fetches; without it the fuzzer stops with a message instead of fuzzing nothing. */
#ifndef BATON_FUZZ_ROUTER_MODEL_H
#define BATON_FUZZ_ROUTER_MODEL_H

#include "common/log.h"
#include "router/router.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static rtr_model_t fuzz_model;

static void fuzz_model_load(void)
{
    static char path[1024];
    const char *env = getenv("BATON_MODEL"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (env && *env) snprintf(path, sizeof path, "%s", env);
    else if (xdg && *xdg) snprintf(path, sizeof path, "%s/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf", xdg);
    else snprintf(path, sizeof path, "%s/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf", home ? home : "/root");
    if (access(path, R_OK) != 0 || rtr_model_load(path, 2048, &fuzz_model) != BT_OK) {
        fprintf(stderr, "fuzz: cannot load the default model %s (run deploy/fetch-model.sh)\n", path);
        exit(1);
    }
}

/* What the router relies on in an accepted embeddings request (HTTP or gRPC): aborts otherwise. */
static inline void fuzz_check_embed(const rtr_embed_req_t *e)
{
    uint64_t sum = 0;
    if (!e->n || e->n > RTR_EMBED_MAX_INPUTS) abort();
    for (size_t i = 0; i < e->n; i++) {
        if (!e->inputs[i].n || e->inputs[i].n > (size_t)fuzz_model.n_ctx) abort();
        for (size_t k = 0; k < e->inputs[i].n; k++)
            if (e->inputs[i].ids[k] < 0 || e->inputs[i].ids[k] >= tok_n_vocab(fuzz_model.tok)) abort();
        sum += e->inputs[i].n;
    }
    if (sum != e->tokens) abort();
}

/* Every router fuzzer starts the same way: quiet logs, the model loaded once. */
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    bt_log_set_level(BT_LOG_ERROR);
    fuzz_model_load();
    return 0;
}

#endif
