/* baton-router: flags and signals; everything else is in router.c.
 * main = apply_env (defaults, BATON_* variables) -> parse_flags (each flag by the take_* step of its kind, then
 * the checks that need them all) -> serve (signals, rtr_create, rtr_start, wait, rtr_destroy). */
#include "router/router.h"
#include "router/tool_calls.h"

#include "common/log.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: baton-router --model PATH --etcd URL [options]\n"
            "  --model PATH              GGUF file (only tokenizer, chat template and metadata are read)\n"
            "  --served-model-name NAME  the model id clients see and send (default: the file name in lower case\n"
            "                            without its quantization tag, e.g. smollm2-135m-instruct); the GGUF's\n"
            "                            general.name and the file name stay accepted\n"
            "  --chat-template builtin:NAME|FILE\n"
            "                            a built-in chat template (chatml, llama3, mistral, gemma, zephyr) or a Jinja\n"
            "                            file, instead of the model's own template (rendered by the interpreter)\n"
            "  --tool-call-parser auto|hermes|llama3|mistral|mistral-args|none\n"
            "                            how tool calls are read from the model's output (tools on\n"
            "                            /v1/chat/completions); auto (default) detects it from the chat template's\n"
            "                            text: <tool_call> = hermes (Hermes, Qwen 2.5/3), <|python_tag|> = llama3,\n"
            "                            [TOOL_CALLS] = mistral ([ARGS] = mistral-args); none refuses tools\n"
            "  --etcd URL[,URL]          etcd endpoints\n"
            "  --http-listen HOST:PORT   OpenAI API, /health, /metrics (default 127.0.0.1:8000)\n"
            "  --grpc-listen HOST:PORT   baton.v1.Generation and health (default 127.0.0.1:50051)\n"
            "  --api-key KEY             require this bearer key on public routes (repeatable)\n"
            "  --cluster NAME            etcd cluster name (default \"default\")\n"
            "  --max-context N           cap on prompt + output tokens (default 8192)\n"
            "  --max-migrations N        decode-node failures one stream survives (default 3)\n"
            "  --http-threads N          HTTP worker threads (default 4)\n"
            "  --max-inflight N          choices in progress at once (a request counts n), beyond: 429\n"
            "                            (default 1024)\n"
            "  --max-queue-s S           refuse (429 + Retry-After / RESOURCE_EXHAUSTED) a request whose predicted\n"
            "                            queue time, from the cluster's measured token rate and the work in\n"
            "                            flight, exceeds S seconds (default 30; 0 = off)\n"
            "  --http-max-connections N  open HTTP connections (default 1024)\n"
            "  --http-max-connections-per-ip N\n"
            "                            open HTTP connections per client address (default 256)\n"
            "  --http-idle-timeout S     close an HTTP connection idle this long (default 60)\n"
            "  --http-read-timeout S     close an HTTP connection whose request has not fully arrived S seconds\n"
            "                            after it started or after its previous answer (default 30)\n"
            "  --http-max-memory-mb MB   request bodies and SSE buffers together; beyond: 503 (default 256)\n"
            "  --grpc-tls-cert PEM       certificate chain: TLS on the gRPC listener (with --grpc-tls-key)\n"
            "  --grpc-tls-key PEM        its private key\n"
            "  --grpc-tls-client-ca PEM  require client certificates signed by this CA (mTLS)\n"
            "  --prefill-mode MODE       auto: a cost model picks local or remote prefill per request;\n"
            "                            local: decode nodes always prefill; remote: a prefill node whenever one\n"
            "                            is healthy (default auto)\n"
            "  --remote-prefill-overhead-ms MS\n"
            "                            fixed cost the model adds to a remote prefill (default 5)\n"
            "  --ttft-slo-ms MS          refuse at once (429 / RESOURCE_EXHAUSTED) a request whose best predicted\n"
            "                            time to first token exceeds MS (default 0: off); also the planner's\n"
            "                            p90 TTFT target (default 2000 ms when off)\n"
            "  --tpot-slo-ms MS          the planner's p90 time-per-output-token target (default 200)\n"
            "  --planner-profile FILE    plan with this `baton profile` JSON instead of the step-time fits the\n"
            "                            nodes publish in their load reports\n"
            "  --planner-window-s S      a lower desired replica count must hold this long before it is\n"
            "                            exported (default 60; a higher one is exported at once)\n"
            "  --decision-log PATH       append every placement decision to PATH as one JSON object per line\n"
            "  --tls-cert PEM, --tls-key PEM\n"
            "                            the router's certificate and key: HTTPS on the OpenAI API, TLS on the gRPC\n"
            "                            API, and the client certificate of calls to nodes\n"
            "  --tls-ca PEM              CA of the cluster: calls to nodes verify each node's certificate names its\n"
            "                            node id (mutual TLS with --tls-cert)\n"
            "  --etcd-user NAME          authenticate to etcd as NAME\n"
            "  --etcd-password-file F    its password, first line of F (never on the command line)\n"
            "  --etcd-ca PEM, --etcd-cert PEM, --etcd-key PEM\n"
            "                            TLS to https:// etcd endpoints: CA, client certificate and key\n"
            "  --stall-timeout-ms MS     a stream whose decode node sent no token to it or any other stream for MS\n"
            "                            (or 50 of the node's steps, when longer) moves to another decode node;\n"
            "                            0: off (default 3000)\n"
            "  --load-stale-ms MS        a decode node whose load report is older than MS while etcd answers gets\n"
            "                            no new work while another node is fit (nodes report every second); 0: off\n"
            "                            (default 3000)\n"
            "  --rejoin-grace-ms MS      nodes whose leases vanish as etcd comes back from an outage stay in the\n"
            "                            view this long while they re-register; 0: off (default 10000)\n"
            "  --request-timeout-s S     deadline of a request at the decode (and prefill) nodes, all migrations\n"
            "                            together; 0: none (default 1200)\n"
            "  --grace-ms MS             on SIGTERM/SIGINT: readiness turns false, new requests get 503 /\n"
            "                            UNAVAILABLE, and requests in flight get MS to finish before the rest are\n"
            "                            cancelled (BATON_GRACE_MS; default 30000)\n"
            "Environment: BATON_MODEL, BATON_ETCD, BATON_HTTP_LISTEN, BATON_GRPC_LISTEN, BATON_API_KEY,\n"
            "BATON_CLUSTER, BATON_TLS_CERT, BATON_TLS_KEY, BATON_TLS_CA, BATON_ETCD_USER, BATON_ETCD_PASSWORD_FILE,\n"
            "BATON_ETCD_CA, BATON_ETCD_CERT, BATON_ETCD_KEY, BATON_GRACE_MS (flags win).\n");
}

static const char *env_or(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

/* Copies a path flag into dst[cap]; 0 on success, else prints why. */
static int take_path(const char *flag, const char *v, char *dst, size_t cap)
{
    if (strlen(v) >= cap) {
        fprintf(stderr, "baton-router: %s is longer than %zu bytes\n", flag, cap - 1);
        return -1;
    }
    snprintf(dst, cap, "%s", v);
    return 0;
}

/* The TLS and etcd credential flags (value v for flag a); 1 = taken, 0 = not one of them, -1 = bad value. */
static int take_security_flag(rtr_config_t *cfg, const char *a, const char *v, const char **pw_file)
{
    struct {
        const char *flag;
        char *dst;
        size_t cap;
    } paths[] = {
        {"--tls-cert", cfg->tls.cert, sizeof cfg->tls.cert},    {"--tls-key", cfg->tls.key, sizeof cfg->tls.key},
        {"--tls-ca", cfg->tls.ca, sizeof cfg->tls.ca},          {"--etcd-ca", cfg->etcd_tls.ca, sizeof cfg->etcd_tls.ca},
        {"--etcd-cert", cfg->etcd_tls.cert, sizeof cfg->etcd_tls.cert},
        {"--etcd-key", cfg->etcd_tls.key, sizeof cfg->etcd_tls.key},
        {"--etcd-user", cfg->etcd_user, sizeof cfg->etcd_user},
    };
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
        if (!strcmp(a, paths[i].flag)) return take_path(a, v, paths[i].dst, paths[i].cap) ? -1 : 1;
    if (!strcmp(a, "--etcd-password-file")) {
        *pw_file = v;
        return 1;
    }
    return 0;
}

/* Environment defaults of the security flags (flags given later win). */
static int security_env(rtr_config_t *cfg, const char **pw_file)
{
    static const char *const pairs[][2] = {
        {"BATON_TLS_CERT", "--tls-cert"}, {"BATON_TLS_KEY", "--tls-key"},     {"BATON_TLS_CA", "--tls-ca"},
        {"BATON_ETCD_CA", "--etcd-ca"},   {"BATON_ETCD_CERT", "--etcd-cert"}, {"BATON_ETCD_KEY", "--etcd-key"},
        {"BATON_ETCD_USER", "--etcd-user"}, {"BATON_ETCD_PASSWORD_FILE", "--etcd-password-file"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        const char *v = env_or(pairs[i][0], NULL);
        if (v && take_security_flag(cfg, pairs[i][1], v, pw_file) < 0) return -1;
    }
    return 0;
}

/* Checks the TLS files and reads the etcd password (secrets come from files only). */
static int security_finish(rtr_config_t *cfg, const char *pw_file)
{
    if (bt_tls_files_check(&cfg->tls, "--tls", 1) != BT_OK || bt_tls_files_check(&cfg->etcd_tls, "--etcd", 1) != BT_OK)
        goto bad;
    if (!cfg->etcd_user[0] != !pw_file) {
        fprintf(stderr, "baton-router: --etcd-user and --etcd-password-file go together\n");
        return -1;
    }
    if (pw_file &&
        bt_tls_read_secret("--etcd-password-file", pw_file, cfg->etcd_password, sizeof cfg->etcd_password) != BT_OK)
        goto bad;
    return 0;
bad:
    fprintf(stderr, "baton-router: %s\n", bt_last_error());
    return -1;
}

/* What the command line and the environment say, before the router starts. */
typedef struct rtr_args {
    rtr_config_t cfg;
    const char *keys[16]; /* --api-key values, BATON_API_KEY first */
    size_t n_keys;
    const char *pw_file;  /* --etcd-password-file / BATON_ETCD_PASSWORD_FILE */
    long grace_ms;        /* --grace-ms / BATON_GRACE_MS: the drain on SIGTERM; -1 = a bad value */
} rtr_args;

#define RTR_GRACE_MS_MAX (3600 * 1000)

/* Milliseconds from 0 to RTR_GRACE_MS_MAX, else -1. */
static long parse_grace_ms(const char *v)
{
    char *end = NULL;
    long ms = strtol(v, &end, 10);
    return !*v || *end || ms < 0 || ms > RTR_GRACE_MS_MAX ? -1 : ms;
}

/* The defaults and the BATON_* variables (flags given later win); -1 when a variable's value is bad (printed). */
static int apply_env(rtr_args *a)
{
    memset(a, 0, sizeof *a);
    a->cfg = (rtr_config_t){
        .model_path = env_or("BATON_MODEL", NULL),
        .etcd = env_or("BATON_ETCD", NULL),
        .http_listen = env_or("BATON_HTTP_LISTEN", "127.0.0.1:8000"),
        .grpc_listen = env_or("BATON_GRPC_LISTEN", "127.0.0.1:50051"),
        .cluster = env_or("BATON_CLUSTER", NULL),
        .remote_prefill_overhead_ms = RTR_PLACE_DEFAULT_OVERHEAD_MS,
    };
    a->grace_ms = parse_grace_ms(env_or("BATON_GRACE_MS", "30000"));
    if (security_env(&a->cfg, &a->pw_file)) return -1;
    if (env_or("BATON_API_KEY", NULL)) a->keys[a->n_keys++] = getenv("BATON_API_KEY");
    return 0;
}

/* Flags whose value is kept as given: addresses, names, files. 1 = taken, 0 = not one of them. */
static int take_text_flag(rtr_config_t *cfg, const char *a, const char *v)
{
    struct {
        const char *flag;
        const char **dst;
    } texts[] = {
        {"--model", &cfg->model_path},
        {"--served-model-name", &cfg->served_model_name},
        {"--chat-template", &cfg->chat_template},
        {"--etcd", &cfg->etcd},
        {"--http-listen", &cfg->http_listen},
        {"--grpc-listen", &cfg->grpc_listen},
        {"--cluster", &cfg->cluster},
        {"--grpc-tls-cert", &cfg->grpc_tls_cert},
        {"--grpc-tls-key", &cfg->grpc_tls_key},
        {"--grpc-tls-client-ca", &cfg->grpc_tls_client_ca},
        {"--decision-log", &cfg->decision_log},
        {"--planner-profile", &cfg->planner_profile},
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        if (!strcmp(a, texts[i].flag)) {
            *texts[i].dst = v;
            return 1;
        }
    return 0;
}

/* --prefill-mode, the placement model's milliseconds and --tool-call-parser (the flags whose value is one of a few
 * names or a bounded number). 1 = taken, 0 = not one of them, -1 = bad (printed). */
static int take_placement_flag(rtr_config_t *cfg, const char *a, const char *v)
{
    if (!strcmp(a, "--tool-call-parser")) {
        rtr_tool_format f;
        if (rtr_tool_format_choose(v, NULL, 0, &f) == BT_OK) {
            cfg->tool_call_parser = v;
            return 1;
        }
        fprintf(stderr, "baton-router: %s\n", bt_last_error());
        return -1;
    }
    if (!strcmp(a, "--prefill-mode")) {
        if (rtr_prefill_mode_parse(v, &cfg->prefill_mode) == BT_OK) return 1;
        fprintf(stderr, "baton-router: --prefill-mode: %s\n", bt_last_error());
        return -1;
    }
    if (!strcmp(a, "--planner-window-s")) {
        char *e = NULL;
        long w = strtol(v, &e, 10);
        if (!*v || *e || w < 1 || w > PLAN_MAX_WINDOW) {
            fprintf(stderr, "baton-router: --planner-window-s: '%s' is not 1 to %d seconds\n", v, PLAN_MAX_WINDOW);
            return -1;
        }
        cfg->planner_window_s = (int)w;
        return 1;
    }
    if (strcmp(a, "--remote-prefill-overhead-ms") && strcmp(a, "--ttft-slo-ms") && strcmp(a, "--tpot-slo-ms")) return 0;
    char *end = NULL;
    double x = strtod(v, &end);
    if (!*v || *end || !(x >= 0) || x > 3.6e6) {
        fprintf(stderr, "baton-router: %s: '%s' is not a valid number of milliseconds\n", a, v);
        return -1;
    }
    if (!strcmp(a, "--ttft-slo-ms")) cfg->ttft_slo_ms = x;
    else if (!strcmp(a, "--tpot-slo-ms")) cfg->tpot_slo_ms = x;
    else cfg->remote_prefill_overhead_ms = x;
    return 1;
}

/* The fail-over timers and the request deadline (0 on the command line: off). 1 = taken, 0 = not one of them,
 * -1 = bad (printed). */
static int take_timer_flag(rtr_config_t *cfg, const char *a, const char *v)
{
    if (strcmp(a, "--stall-timeout-ms") && strcmp(a, "--load-stale-ms") && strcmp(a, "--rejoin-grace-ms") &&
        strcmp(a, "--request-timeout-s"))
        return 0;
    char *end = NULL;
    long n = strtol(v, &end, 10);
    long max = !strcmp(a, "--request-timeout-s") ? 86400 * 7 : 3600 * 1000;
    if (!*v || *end || n < 0 || n > max) {
        fprintf(stderr, "baton-router: %s: '%s' is not a number from 0 to %ld\n", a, v, max);
        return -1;
    }
    int x = n ? (int)n : -1; /* 0 on the command line: off */
    if (!strcmp(a, "--stall-timeout-ms")) cfg->stall_ms = x;
    else if (!strcmp(a, "--load-stale-ms")) cfg->load_stale_ms = x;
    else if (!strcmp(a, "--rejoin-grace-ms")) cfg->rejoin_grace_ms = x;
    else cfg->request_timeout_ms = n ? (int)(n * 1000) : -1;
    return 1;
}

/* Admission and HTTP limits: --max-queue-s and the counts. 1 = taken, 0 = not one of them, -1 = bad (printed). */
static int take_limit_flag(rtr_config_t *cfg, const char *a, const char *v)
{
    char *end = NULL;
    if (!strcmp(a, "--max-queue-s")) {
        double x = strtod(v, &end);
        if (!*v || *end || !(x >= 0) || x > 86400) {
            fprintf(stderr, "baton-router: --max-queue-s: '%s' is not a number of seconds in [0, 86400]\n", v);
            return -1;
        }
        cfg->max_queue_s = x == 0 ? -1 : x; /* 0 on the command line: off */
        return 1;
    }
    if (strcmp(a, "--max-context") && strcmp(a, "--max-migrations") && strcmp(a, "--http-threads") &&
        strcmp(a, "--max-inflight") && strcmp(a, "--http-max-connections") &&
        strcmp(a, "--http-max-connections-per-ip") && strcmp(a, "--http-idle-timeout") &&
        strcmp(a, "--http-read-timeout") && strcmp(a, "--http-max-memory-mb"))
        return 0;
    long n = strtol(v, &end, 10);
    if (!*v || *end || n < 0 || n > (1 << 24)) {
        fprintf(stderr, "baton-router: %s: '%s' is not a valid number\n", a, v);
        return -1;
    }
    if (!strcmp(a, "--max-context")) cfg->max_context = (int32_t)n;
    else if (!strcmp(a, "--max-migrations")) cfg->max_migrations = (int)n;
    else if (!strcmp(a, "--max-inflight")) cfg->max_inflight = (int)n;
    else if (!strcmp(a, "--http-max-connections")) cfg->http_max_connections = (unsigned)n;
    else if (!strcmp(a, "--http-max-connections-per-ip")) cfg->http_max_per_ip = (unsigned)n;
    else if (!strcmp(a, "--http-idle-timeout")) cfg->http_idle_timeout_s = (unsigned)n;
    else if (!strcmp(a, "--http-read-timeout")) cfg->http_read_timeout_s = (unsigned)n;
    else if (!strcmp(a, "--http-max-memory-mb")) cfg->http_max_memory = (size_t)n << 20;
    else cfg->http_threads = (unsigned)n;
    return 1;
}

/* One flag a with its value v. 1 = taken, 0 = unknown, -1 = bad value (printed). */
static int take_flag(rtr_args *r, const char *a, const char *v)
{
    int t;
    if ((t = take_security_flag(&r->cfg, a, v, &r->pw_file)) || (t = take_text_flag(&r->cfg, a, v)) ||
        (t = take_placement_flag(&r->cfg, a, v)) || (t = take_timer_flag(&r->cfg, a, v)) ||
        (t = take_limit_flag(&r->cfg, a, v)))
        return t;
    if (!strcmp(a, "--grace-ms")) {
        r->grace_ms = parse_grace_ms(v);
        return 1;
    }
    if (strcmp(a, "--api-key")) return 0;
    if (r->n_keys == 16) {
        fprintf(stderr, "baton-router: at most 16 --api-key\n");
        return -1;
    }
    r->keys[r->n_keys++] = v;
    return 1;
}

/* The command line over the environment, then the checks that need every flag. Returns -1 to go on, else the exit
 * code (0 after --help, 2 for a bad or missing flag). */
static int parse_flags(rtr_args *r, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "baton-router: %s needs a value (or is unknown)\n", a);
            usage(stderr);
            return 2;
        }
        int t = take_flag(r, a, argv[++i]);
        if (t < 0) return 2;
        if (t == 0) {
            fprintf(stderr, "baton-router: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!r->cfg.model_path || !r->cfg.etcd) {
        fprintf(stderr, "baton-router: --model and --etcd are required\n");
        usage(stderr);
        return 2;
    }
    if (r->grace_ms < 0) {
        fprintf(stderr, "baton-router: --grace-ms / BATON_GRACE_MS expects milliseconds from 0 to %d\n",
                RTR_GRACE_MS_MAX);
        return 2;
    }
    if (security_finish(&r->cfg, r->pw_file)) return 2;
    r->cfg.api_keys = r->keys;
    r->cfg.n_api_keys = r->n_keys;
    return -1;
}

/* Starts the router and serves until SIGINT or SIGTERM, then drains for grace_ms; the process exit code. */
static int serve(const rtr_config_t *cfg, long grace_ms)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread inherits the mask; main waits for them below */
    signal(SIGPIPE, SIG_IGN);

    rtr_t *r;
    if (rtr_create(cfg, &r) != BT_OK) {
        fprintf(stderr, "baton-router: %s\n", bt_last_error());
        return 1;
    }
    if (rtr_start(r) != BT_OK) {
        fprintf(stderr, "baton-router: %s\n", bt_last_error());
        rtr_destroy(r);
        return 1;
    }
    int sig = 0;
    sigwait(&set, &sig);
    BT_INFO("router", "signal %d: shutting down", sig);
    rtr_drain(r, (int)grace_ms);
    rtr_destroy(r);
    return 0;
}

int main(int argc, char **argv)
{
    rtr_args args;
    if (apply_env(&args)) return 2;
    int rc = parse_flags(&args, argc, argv);
    if (rc >= 0) return rc;
    return serve(&args.cfg, args.grace_ms);
}
