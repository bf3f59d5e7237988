/* `baton generate`: run one prompt through the engine and stream the text as it is produced.
 * `baton embed`: embeddings of texts (the scheduler's embedding requests, batched).
 * `baton logits`: teacher-forced logits of a token id list, for oracle tests. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/paths.h"
#include "engine/backend_cpu.h"
#include "engine/chat_template.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/tokenizer.h"
#include "tools/commands.h"
#include "tools/seq_runner.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void generate_usage(FILE *out)
{
    fprintf(out,
            "usage: baton generate [--model PATH] (--prompt TEXT | --chat TEXT) [options]\n"
            "  --model PATH          GGUF model (default: the cached default model, see `baton model fetch`)\n"
            "  --prompt TEXT         raw prompt, tokenized as is\n"
            "  --chat TEXT           a user message, rendered with the model's chat template\n"
            "  --system TEXT         system message for --chat\n"
            "  --chat-template builtin:NAME|FILE\n"
            "                        a built-in chat template (chatml, llama3, mistral, gemma, zephyr) or a Jinja\n"
            "                        file, instead of the model's own template\n"
            "  --max-tokens N        tokens to generate (default 128)\n"
            "  --temperature T       0 = greedy (default 0)\n"
            "  --top-k K             (default 0 = off)\n"
            "  --top-p P             (default 1 = off)\n"
            "  --min-p P             (default 0 = off)\n"
            "  --seed S              sampling seed (default 0)\n"
            "  --threads N           compute threads (default: all CPUs)\n"
            "  --device cpu|cuda:N   the backend (default cpu; cuda needs a GPU, its driver and libbaton_cuda.so)\n"
            "  --ctx N               context length (default: the model's, at most 8192)\n"
            "  --kv-dtype D          KV cache element type: f16 (default), f32, int8\n"
            "  --spec S              speculative decoding: none (default), ngram[:MIN-MAX], draft:PATH, self:L; the output\n"
            "                        is the same token for token, only the speed differs\n"
            "  --spec-k-max N        most draft tokens per step, 1..16 (default 8)\n"
            "  --spec-fixed-k        always draft k-max tokens (no adaptive k): what drafting costs, for tests\n"
            "  --ids                 print token ids instead of text\n"
            "  --ignore-eos          keep generating past end-of-generation tokens\n"
            "  --quiet               no statistics on stderr\n");
}

/* Parses a number with range checks; prints an error naming the flag. */
static int parse_long(const char *flag, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "baton: %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_float(const char *flag, const char *s, float lo, float hi, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || end == s || !(v >= lo && v <= hi)) {
        fprintf(stderr, "baton: %s expects a number in [%g, %g], got '%s'\n", flag, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

typedef struct gen_opts {
    const char *model, *prompt, *chat, *system, *tmpl;
    long max_tokens, threads, ctx;
    int kv_dtype;
    int device; /* --device: -1 cpu */
    bt_sampling sp;
    bt_spec_config spec;
    int ids, quiet, spec_fixed_k;
} gen_opts;

static int parse_gen(int argc, char **argv, gen_opts *o)
{
    memset(o, 0, sizeof *o);
    o->max_tokens = 128;
    o->device = -1;
    o->sp = bt_sampling_default();
    o->spec = bt_spec_config_default();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            generate_usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--ids")) { o->ids = 1; continue; }
        if (!strcmp(a, "--ignore-eos")) { o->sp.ignore_eos = true; continue; }
        if (!strcmp(a, "--quiet")) { o->quiet = 1; continue; }
        if (!strcmp(a, "--spec-fixed-k")) { o->spec_fixed_k = 1; continue; }
        if (!v) {
            fprintf(stderr, "baton generate: unknown option or missing value: '%s'\n", a);
            return -1;
        }
        i++;
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--prompt")) o->prompt = v;
        else if (!strcmp(a, "--chat")) o->chat = v;
        else if (!strcmp(a, "--system")) o->system = v;
        else if (!strcmp(a, "--chat-template")) o->tmpl = v;
        else if (!strcmp(a, "--kv-dtype")) {
            if ((o->kv_dtype = bt_kv_dtype_from_name(v)) < 0) {
                fprintf(stderr, "baton generate: --kv-dtype expects f16, f32 or int8, got '%s'\n", v);
                return -1;
            }
        }
        else if (!strcmp(a, "--max-tokens")) { if (parse_long(a, v, 0, 1 << 20, &o->max_tokens)) return -1; }
        else if (!strcmp(a, "--threads")) { if (parse_long(a, v, 0, 256, &o->threads)) return -1; }
        else if (!strcmp(a, "--device")) { if (cli_device_parse("generate", v, &o->device)) return -1; }
        else if (!strcmp(a, "--ctx")) { if (parse_long(a, v, 16, 1 << 20, &o->ctx)) return -1; }
        else if (!strcmp(a, "--top-k")) { if (parse_long(a, v, 0, INT32_MAX, &n)) return -1; o->sp.top_k = (int32_t)n; }
        else if (!strcmp(a, "--seed")) { if (parse_long(a, v, 0, LONG_MAX, &n)) return -1; o->sp.seed = (uint64_t)n; }
        else if (!strcmp(a, "--temperature")) { if (parse_float(a, v, 0, 100, &o->sp.temperature)) return -1; }
        else if (!strcmp(a, "--top-p")) { if (parse_float(a, v, 0, 1, &o->sp.top_p)) return -1; }
        else if (!strcmp(a, "--min-p")) { if (parse_float(a, v, 0, 1, &o->sp.min_p)) return -1; }
        else if (!strcmp(a, "--spec")) {
            if (bt_spec_parse(v, &o->spec)) {
                fprintf(stderr, "baton generate: %s\n", bt_last_error());
                return -1;
            }
        }
        else if (!strcmp(a, "--spec-k-max")) {
            if (parse_long(a, v, 1, BT_SPEC_K_LIMIT, &n)) return -1;
            o->spec.k_max = (int32_t)n;
        }
        else {
            fprintf(stderr, "baton generate: unknown option '%s'\n", a);
            return -1;
        }
    }
    if (!o->prompt == !o->chat) {
        fprintf(stderr, "baton generate: give exactly one of --prompt or --chat\n");
        return -1;
    }
    if (bt_sampling_check(&o->sp)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        return -1;
    }
    return 0;
}

/* Resolves --model (or the default), loads it, and prints one clear line on failure. */
static bt_model *load_model_or_report(const char *cmd, const char *path)
{
    char def[4096];
    if (!path) {
        if (bt_default_model_path(def, sizeof def)) {
            fprintf(stderr, "baton %s: %s\n", cmd, bt_last_error());
            return NULL;
        }
        path = def;
    }
    bt_model *m;
    if (bt_model_load(path, &m)) {
        fprintf(stderr, "baton %s: %s\n", cmd, bt_last_error());
        if (path == def) fprintf(stderr, "baton %s: fetch the default model with `baton model fetch`\n", cmd);
        return NULL;
    }
    return m;
}

typedef struct gen_state {
    tok_stream *ts;
    int ids;
    long produced;
    double t0, t_first;
    bt_end_reason end;
    bt_status error;
} gen_state;

/* Streams each token as it is sampled (engine thread = this thread: bt_sched_step runs here). */
static void gen_emit(void *user, const bt_sched_event *ev)
{
    gen_state *g = user;
    if (ev->finish != BT_END_NONE) {
        g->end = ev->finish;
        g->error = ev->error;
    }
    if (ev->token < 0) return;
    if (g->produced++ == 0) g->t_first = now_s();
    if (ev->finish == BT_END_STOP && !g->ids) return; /* the end-of-generation token itself is not text */
    if (g->ids) {
        printf("%s%d", ev->index ? " " : "", ev->token);
    } else {
        const char *piece;
        size_t len;
        if (tok_stream_push(g->ts, ev->token, &piece, &len) == BT_OK && len) fwrite(piece, 1, len, stdout);
    }
    fflush(stdout);
}

int cmd_generate(int argc, char **argv)
{
    gen_opts o;
    int pr = parse_gen(argc, argv, &o);
    if (pr) return pr > 0 ? 0 : 2;
    cli_engine_env env;
    if (cli_engine_env_read("generate", (int)o.threads, &env)) return 1;
    env.device = o.device;
    bt_model *m = load_model_or_report("generate", o.model);
    if (!m) return 1;
    int rc = 1;
    tok_tokenizer *tok = NULL;
    chat_tmpl tmpl;
    int have_tmpl = 0;
    char *text = NULL;
    size_t text_len = 0;
    tok_ids ids = {0};
    bt_backend *be = NULL;
    bt_sched *sched = NULL;
    bt_proposer *proposer = NULL;
    int32_t eog[16];
    int32_t n_eog = 0;
    tok_stream ts;
    tok_stream_init(&ts, NULL, 0);

    if (tok_create(m->file, &tok)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        goto out;
    }
    if (o.chat) {
        if (chat_tmpl_init_gguf(&tmpl, m->file, o.tmpl)) {
            fprintf(stderr, "baton generate: %s\n", bt_last_error());
            goto out;
        }
        have_tmpl = 1;
        chat_msg msgs[2];
        size_t n = 0;
        if (o.system) msgs[n++] = (chat_msg){"system", o.system, strlen(o.system), NULL};
        msgs[n++] = (chat_msg){"user", o.chat, strlen(o.chat), NULL};
        if (chat_tmpl_render(&tmpl, msgs, n, 1, &text, &text_len)) {
            fprintf(stderr, "baton generate: %s\n", bt_last_error());
            goto out;
        }
    } else {
        text_len = strlen(o.prompt);
        text = malloc(text_len + 1);
        if (!text) goto out;
        memcpy(text, o.prompt, text_len + 1);
    }
    /* Chat renderings already carry their special tokens as text; raw prompts get BOS per the file's rule. */
    if (tok_encode(tok, text, text_len, TOK_PARSE_SPECIAL | (o.chat ? 0u : TOK_ADD_SPECIAL), &ids)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        goto out;
    }
    if (ids.n == 0) {
        fprintf(stderr, "baton generate: the prompt is empty\n");
        goto out;
    }
    long ctx = o.ctx ? o.ctx : bt_sched_default_context(m);
    if ((long)ids.n + o.max_tokens > ctx) {
        fprintf(stderr,
                "baton generate: prompt of %zu tokens + max_tokens %ld exceeds the context of %ld tokens "
                "(shorten the prompt, lower --max-tokens or raise --ctx)\n",
                ids.n, o.max_tokens, ctx);
        goto out;
    }
    if (cli_backend_create(&env, &be)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        goto out;
    }
    /* end-of-generation ids of this vocabulary */
    for (int32_t i = 0; i < tok_n_vocab(tok); i++)
        if (tok_is_eog(tok, i) && n_eog < (int32_t)(sizeof eog / sizeof eog[0])) eog[n_eog++] = i;
    bt_sched_config sc = {0};
    sc.kv_dtype = (bt_kv_dtype)o.kv_dtype;
    sc.kv_mem = bt_kv_block_stride(&m->hp, sc.kv_dtype) * (size_t)m->hp.n_layer * (size_t)((ctx + 15) / 16 + 1);
    sc.max_context = (int32_t)ctx;
    sc.eog_ids = eog;
    sc.n_eog = n_eog;
    sc.profile = env.profile;
    o.spec.profile = env.profile;
    if (bt_spec_create(&o.spec, m, be, (int32_t)ctx, 1, &proposer)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        goto out;
    }
    sc.proposer = proposer;
    sc.spec_k_max = o.spec.k_max;
    sc.spec_fixed_k = o.spec_fixed_k;
    if (bt_sched_create(m, be, &sc, &sched)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        goto out;
    }
    tok_stream_init(&ts, tok, TOK_SKIP_SPECIAL);
    gen_state gs = {.ts = &ts, .ids = o.ids, .t0 = now_s()};
    bt_req_params rp = bt_req_params_default();
    rp.sampling = o.sp;
    rp.sampling.max_tokens = (int32_t)o.max_tokens;
    if (o.max_tokens == 0) goto done; /* nothing to generate */
    if (bt_sched_submit(sched, ids.ids, (int32_t)ids.n, &rp, gen_emit, &gs, NULL)) {
        fprintf(stderr, "baton generate: %s\n", bt_last_error());
        goto out;
    }
    while (!bt_sched_idle(sched))
        if (bt_sched_step(sched) < 0) break;
    if (gs.end == BT_END_ERROR) {
        fprintf(stderr, "\nbaton generate: %s\n", bt_status_str(gs.error));
        goto out;
    }
done:
    if (!o.ids) {
        const char *piece;
        size_t len;
        tok_stream_flush(&ts, &piece, &len);
        if (len) fwrite(piece, 1, len, stdout);
    }
    putchar('\n');
    fflush(stdout);
    double t2 = now_s();
    /* the first token comes with the prompt's forward pass: prompt time = until the first token */
    double t1 = gs.t_first > 0 ? gs.t_first : t2;
    long decoded = gs.produced > 0 ? gs.produced - 1 : 0;
    if (!o.quiet)
        fprintf(stderr,
                "[%s | %s, %d-bit activations, %d threads] prompt %zu tokens in %.3f s (%.1f tok/s); "
                "generated %ld tokens, %ld more in %.3f s (%.1f tok/s); finish: %s\n",
                m->name, bt_backend_cpu_isa(be), bt_backend_cpu_act_bits(be), bt_backend_cpu_threads(be), ids.n,
                t1 - gs.t0, ids.n / (t1 - gs.t0), gs.produced, decoded, t2 - t1, decoded > 0 ? decoded / (t2 - t1) : 0.0,
                gs.end == BT_END_STOP ? "stop" : "length");
    if (!o.quiet && proposer) {
        bt_sched_stats st;
        bt_sched_get_stats(sched, &st);
        fprintf(stderr,
                "[speculation %s, k up to %d] %llu drafts proposed, %llu accepted (%.0f%%), %.2f tokens per "
                "verification step\n",
                bt_spec_kind_name(o.spec.kind), o.spec.k_max, (unsigned long long)st.spec_proposed,
                (unsigned long long)st.spec_accepted,
                st.spec_proposed ? 100.0 * (double)st.spec_accepted / (double)st.spec_proposed : 0.0,
                st.spec_verifications ? 1.0 + (double)st.spec_accepted / (double)st.spec_verifications : 0.0);
    }
    rc = 0;
out:
    bt_sched_destroy(sched);
    bt_proposer_destroy(proposer);
    bt_backend_destroy(be);
    tok_stream_free(&ts);
    tok_ids_free(&ids);
    free(text);
    if (have_tmpl) chat_tmpl_free(&tmpl);
    tok_free(tok);
    bt_model_free(m);
    return rc;
}

/* baton logits [--model PATH] [--chunk N] --out FILE ID...: writes float32 [n][n_vocab] logits of every
 * position (teacher forcing), feeding the ids in chunks of N. */
int cmd_logits(int argc, char **argv)
{
    const char *model = NULL, *out = NULL;
    long chunk = 64, threads = 0;
    int kv_dtype = BT_KV_F16;
    int32_t *ids = calloc((size_t)argc, sizeof *ids);
    int n = 0;
    if (!ids) return 1;
    for (int i = 1; i < argc; i++) {
        long v;
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) {
            if (parse_long("--chunk", argv[++i], 1, 4096, &chunk)) goto usage;
        } else if (!strcmp(argv[i], "--kv-dtype") && i + 1 < argc) {
            if ((kv_dtype = bt_kv_dtype_from_name(argv[++i])) < 0) goto usage;
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (parse_long("--threads", argv[++i], 0, 256, &threads)) goto usage;
        } else if (parse_long("token id", argv[i], 0, INT32_MAX, &v) == 0) ids[n++] = (int32_t)v;
        else goto usage;
    }
    if (!out || n == 0) goto usage;
    cli_engine_env env;
    if (cli_engine_env_read("logits", (int)threads, &env)) {
        free(ids);
        return 1;
    }
    bt_model *m = load_model_or_report("logits", model);
    if (!m) {
        free(ids);
        return 1;
    }
    int rc = 1;
    seq_runner r;
    FILE *f = NULL;
    if (seq_runner_init(&r, m, &env, n, (int32_t)chunk, (bt_kv_dtype)kv_dtype)) {
        fprintf(stderr, "baton logits: %s\n", bt_last_error());
        goto done;
    }
    f = fopen(out, "wb");
    if (!f) {
        fprintf(stderr, "baton logits: cannot create %s: %s\n", out, strerror(errno));
        goto done_r;
    }
    for (int done = 0; done < n;) {
        int32_t k = n - done < chunk ? n - done : (int32_t)chunk;
        if (seq_runner_feed(&r, ids + done, k, 1)) {
            fprintf(stderr, "baton logits: %s\n", bt_last_error());
            goto done_r;
        }
        fwrite(r.logits, sizeof(float), (size_t)k * (size_t)m->hp.n_vocab, f);
        done += k;
    }
    rc = fclose(f) == 0 ? 0 : 1;
    f = NULL;
done_r:
    if (f) fclose(f);
    seq_runner_free(&r);
done:
    bt_model_free(m);
    free(ids);
    return rc;
usage:
    fprintf(stderr, "usage: baton logits [--model PATH] [--chunk N] [--threads N] [--kv-dtype f16|f32|int8] --out FILE "
                    "ID...\n");
    free(ids);
    return 2;
}

static void embed_usage(FILE *out)
{
    fprintf(out,
            "usage: baton embed [--model PATH] [--threads N] [--batch-tokens N] TEXT...\n"
            "Prints one JSON array per TEXT: the mean of the model's final hidden states (after the output norm)\n"
            "over the text's tokens, L2-normalized, as /v1/embeddings defines it. Texts are tokenized as raw\n"
            "prompts (BOS per the model file, special-token text not parsed) and computed together through the\n"
            "scheduler, in steps of --batch-tokens tokens (default 512); the vectors do not depend on the batching.\n");
}

typedef struct embed_state {
    bt_end_reason end;
    bt_status error;
} embed_state;

static void embed_emit(void *user, const bt_sched_event *ev)
{
    embed_state *e = user;
    if (ev->finish != BT_END_NONE) e->end = ev->finish, e->error = ev->error;
}

int cmd_embed(int argc, char **argv)
{
    const char *model = NULL;
    long threads = 0, batch = BT_SCHED_DEFAULT_BATCH_TOKENS;
    int first_text = argc;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            embed_usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (parse_long("--threads", argv[++i], 0, 256, &threads)) return 2;
        } else if (!strcmp(argv[i], "--batch-tokens") && i + 1 < argc) {
            if (parse_long("--batch-tokens", argv[++i], 1, 1 << 16, &batch)) return 2;
        } else if (!strncmp(argv[i], "--", 2)) {
            fprintf(stderr, "baton embed: unknown option or missing value: '%s'\n", argv[i]);
            embed_usage(stderr);
            return 2;
        } else {
            first_text = i;
            break;
        }
    }
    int n = argc - first_text;
    if (n <= 0) {
        embed_usage(stderr);
        return 2;
    }
    cli_engine_env env;
    if (cli_engine_env_read("embed", (int)threads, &env)) return 1;
    bt_model *m = load_model_or_report("embed", model);
    if (!m) return 1;
    int rc = 1;
    const int32_t E = m->hp.n_embd;
    tok_tokenizer *tok = NULL;
    bt_backend *be = NULL;
    bt_sched *sched = NULL;
    tok_ids *ids = calloc((size_t)n, sizeof *ids);
    float *vecs = malloc(sizeof(float) * (size_t)n * (size_t)E);
    embed_state *st = calloc((size_t)n, sizeof *st);
    if (!ids || !vecs || !st) {
        fprintf(stderr, "baton embed: out of memory\n");
        goto out;
    }
    if (tok_create(m->file, &tok)) {
        fprintf(stderr, "baton embed: %s\n", bt_last_error());
        goto out;
    }
    int32_t ctx = bt_sched_default_context(m), longest = 0;
    for (int i = 0; i < n; i++) {
        const char *t = argv[first_text + i];
        if (tok_encode(tok, t, strlen(t), TOK_ADD_SPECIAL, &ids[i])) {
            fprintf(stderr, "baton embed: text %d: %s\n", i + 1, bt_last_error());
            goto out;
        }
        if (ids[i].n == 0 || (int64_t)ids[i].n > ctx) {
            fprintf(stderr, "baton embed: text %d has %zu tokens (1..%d allowed)\n", i + 1, ids[i].n, ctx);
            goto out;
        }
        if ((int32_t)ids[i].n > longest) longest = (int32_t)ids[i].n;
    }
    if (bt_backend_cpu_create(&env.cpu, &be)) {
        fprintf(stderr, "baton embed: %s\n", bt_last_error());
        goto out;
    }
    bt_sched_config sc = {0};
    sc.kv_mem = bt_kv_block_stride(&m->hp, BT_KV_F16) * (size_t)m->hp.n_layer * (size_t)((longest + 15) / 16 + 1) * 4;
    sc.max_context = ctx;
    sc.max_batch_tokens = (int32_t)batch;
    sc.profile = env.profile;
    if (bt_sched_create(m, be, &sc, &sched)) {
        fprintf(stderr, "baton embed: %s\n", bt_last_error());
        goto out;
    }
    for (int i = 0; i < n; i++) {
        bt_req_params rp = bt_req_params_default();
        rp.embedding = vecs + (size_t)i * (size_t)E;
        if (bt_sched_submit(sched, ids[i].ids, (int32_t)ids[i].n, &rp, embed_emit, &st[i], NULL)) {
            fprintf(stderr, "baton embed: text %d: %s\n", i + 1, bt_last_error());
            goto out;
        }
    }
    while (!bt_sched_idle(sched))
        if (bt_sched_step(sched) < 0) break;
    for (int i = 0; i < n; i++) {
        if (st[i].end != BT_END_STOP) {
            fprintf(stderr, "baton embed: text %d: %s\n", i + 1,
                    st[i].end == BT_END_ERROR ? bt_status_str(st[i].error) : "not computed");
            goto out;
        }
        putchar('[');
        for (int32_t k = 0; k < E; k++) printf("%s%.9g", k ? ", " : "", vecs[(size_t)i * (size_t)E + k]);
        puts("]");
    }
    rc = 0;
out:
    bt_sched_destroy(sched);
    bt_backend_destroy(be);
    for (int i = 0; ids && i < n; i++) tok_ids_free(&ids[i]);
    free(ids);
    free(vecs);
    free(st);
    tok_free(tok);
    bt_model_free(m);
    return rc;
}
