/* node/node.c: the flag parser (flags, BATON_* fallbacks, defaults, errors naming the source) and address splitting;
 * node/node_engine.c's bt_ne_env_read, the nodes' one reader of the engine's switches without a flag. */
#include "common/log.h"
#include "node/node.h"
#include "node/node_engine.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const ENV_VARS[] = {"BATON_MODEL",   "BATON_ETCD",        "BATON_CLUSTER", "BATON_NODE_ID",
                                       "BATON_GRPC_LISTEN", "BATON_HTTP_LISTEN", "BATON_THREADS", "BATON_KV_MEM",
                                       "BATON_MAX_BATCH_TOKENS", "BATON_LOG", "BATON_GRACE_MS",
                                       "BATON_SPEC", "BATON_SPEC_K_MAX", "BATON_TLS_CERT", "BATON_TLS_KEY",
                                       "BATON_TLS_CA", "BATON_INSECURE", "BATON_ETCD_USER",
                                       "BATON_ETCD_PASSWORD_FILE", "BATON_ETCD_CA", "BATON_ETCD_CERT",
                                       "BATON_ETCD_KEY"};

/* Each test starts from an environment without BATON_* so only what it sets can leak into the result. */
static void clear_env(void)
{
    for (size_t i = 0; i < sizeof ENV_VARS / sizeof ENV_VARS[0]; i++) unsetenv(ENV_VARS[i]);
}

/* Parses a NULL-terminated list of arguments (argv[0] is supplied). */
static bt_status parse(bt_node_flags_t *f, mbr_role role, int *help, const char *const *args)
{
    char *argv[32] = {"baton-node"};
    int argc = 1;
    for (; args[argc - 1] && argc < 31; argc++) argv[argc] = (char *)args[argc - 1];
    return bt_node_flags_parse(f, role, argc, argv, help);
}

static void test_split_addr_accepts(void)
{
    char host[64];
    int port = -1;
    CHECK(bt_node_split_addr("127.0.0.1:8080", host, sizeof host, &port) == BT_OK);
    CHECK(!strcmp(host, "127.0.0.1") && port == 8080);
    CHECK(bt_node_split_addr("[::1]:50051", host, sizeof host, &port) == BT_OK);
    CHECK(!strcmp(host, "::1") && port == 50051);
    CHECK(bt_node_split_addr("node-a.example:0", host, sizeof host, &port) == BT_OK);
    CHECK(!strcmp(host, "node-a.example") && port == 0);
    CHECK(bt_node_split_addr("h:65535", host, sizeof host, &port) == BT_OK && port == 65535);
    /* the last colon splits: an unbracketed v6 literal keeps its other colons in the host */
    CHECK(bt_node_split_addr("fe80::1:9000", host, sizeof host, &port) == BT_OK);
    CHECK(!strcmp(host, "fe80::1") && port == 9000);
}

static void test_split_addr_refuses(void)
{
    static const char *const bad[] = {"",     "localhost", ":80",      "h:",      "h:65536", "h:-1",
                                      "h:8x", "[::1]80",   "[::1:80",  "[]:80"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char host[64] = "untouched";
        int port = 7;
        bt_status st = bt_node_split_addr(bad[i], host, sizeof host, &port);
        CHECK_MSG(st == BT_ERR_INVALID, "'%s' gave %d", bad[i], st);
        CHECK_MSG(!strcmp(host, "untouched") && port == 7, "'%s' wrote its outputs on failure", bad[i]);
        CHECK(strlen(bt_last_error()) > 0);
    }
    char small[4];
    int port;
    CHECK(bt_node_split_addr("abcd:1", small, sizeof small, &port) == BT_ERR_INVALID);
    CHECK(bt_node_split_addr("abc:1", small, sizeof small, &port) == BT_OK && !strcmp(small, "abc"));
    CHECK(bt_node_split_addr(NULL, small, sizeof small, &port) == BT_ERR_INVALID);
}

static void test_defaults(void)
{
    clear_env();
    setenv("BATON_MODEL", "/models/m.gguf", 1);
    bt_node_flags_t f;
    int help = 1;
    REQUIRE(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){NULL}) == BT_OK);
    CHECK(help == 0);
    CHECK(!strcmp(f.model, "/models/m.gguf"));
    CHECK(!strcmp(f.etcd, BT_NODE_DEFAULT_ETCD));
    CHECK(!strcmp(f.cluster, MBR_DEFAULT_CLUSTER));
    CHECK(!strncmp(f.node_id, "decode-", 7));
    char pid[32];
    snprintf(pid, sizeof pid, "-%ld", (long)getpid());
    CHECK(strlen(f.node_id) > strlen(pid) && !strcmp(f.node_id + strlen(f.node_id) - strlen(pid), pid));
    CHECK(!strcmp(f.grpc_listen, BT_NODE_DEFAULT_LISTEN) && !strcmp(f.http_listen, BT_NODE_DEFAULT_LISTEN));
    CHECK(f.threads == 0 && f.kv_mem == 0 && f.max_batch_tokens == 0);
    CHECK(f.log_level == -1);
    CHECK(f.grace_ms == BT_NODE_DEFAULT_GRACE_MS);

    REQUIRE(parse(&f, MBR_ROLE_PREFILL, &help, (const char *const[]){NULL}) == BT_OK);
    CHECK(!strncmp(f.node_id, "prefill-", 8));
    clear_env();
}

static void test_flags_and_forms(void)
{
    clear_env();
    bt_node_flags_t f;
    int help;
    REQUIRE(parse(&f, MBR_ROLE_DECODE, &help,
                  (const char *const[]){"--model", "a.gguf", "--etcd=none", "--cluster", "c1", "--node-id", "d.0_x-1",
                                        "--grpc-listen", "[::1]:0", "--http-listen=0.0.0.0:9100", "--threads", "3",
                                        "--kv-mem", "2G", "--max-batch-tokens=64", "--log-level", "warning",
                                        "--grace-ms", "0", NULL}) == BT_OK);
    CHECK(!strcmp(f.model, "a.gguf"));
    CHECK(f.etcd[0] == 0); /* "none": no registration */
    CHECK(!strcmp(f.cluster, "c1"));
    CHECK(!strcmp(f.node_id, "d.0_x-1"));
    CHECK(!strcmp(f.grpc_listen, "[::1]:0") && !strcmp(f.http_listen, "0.0.0.0:9100"));
    CHECK(f.threads == 3);
    CHECK(f.kv_mem == (size_t)2 << 30);
    CHECK(f.max_batch_tokens == 64);
    CHECK(f.log_level == BT_LOG_WARN);
    CHECK(f.grace_ms == 0);
}

static void test_sizes(void)
{
    clear_env();
    static const struct {
        const char *in;
        size_t want;
    } ok[] = {{"1048576", 1048576}, {"512K", 512 << 10}, {"256m", (size_t)256 << 20}, {"1GiB", (size_t)1 << 30},
              {"3MB", (size_t)3 << 20}, {"1T", (size_t)1 << 40}, {"0", 0}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        bt_node_flags_t f;
        int help;
        bt_status st = parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--model", "m", "--kv-mem", ok[i].in, NULL});
        CHECK_MSG(st == BT_OK && f.kv_mem == ok[i].want, "--kv-mem %s: status %d, %zu bytes", ok[i].in, st, f.kv_mem);
    }
    static const char *const bad[] = {"-1", "12Q", "1GG", "M", "", "1Gx", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bt_node_flags_t f;
        int help;
        bt_status st = parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--model", "m", "--kv-mem", bad[i], NULL});
        CHECK_MSG(st == BT_ERR_INVALID, "--kv-mem '%s' gave %d", bad[i], st);
        CHECK(strstr(bt_last_error(), "--kv-mem") != NULL);
    }
}

static void test_environment_fallback(void)
{
    clear_env();
    setenv("BATON_MODEL", "env.gguf", 1);
    setenv("BATON_THREADS", "5", 1);
    setenv("BATON_KV_MEM", "64M", 1);
    setenv("BATON_ETCD", "http://e1:2379,http://e2:2379", 1);
    setenv("BATON_LOG", "debug", 1);
    bt_node_flags_t f;
    int help;
    REQUIRE(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--threads", "2", NULL}) == BT_OK);
    CHECK(f.threads == 2); /* the flag wins over the variable */
    CHECK(f.kv_mem == (size_t)64 << 20);
    CHECK(!strcmp(f.model, "env.gguf"));
    CHECK(!strcmp(f.etcd, "http://e1:2379,http://e2:2379"));
    CHECK(f.log_level == BT_LOG_DEBUG);

    setenv("BATON_THREADS", "many", 1);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){NULL}) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "BATON_THREADS") != NULL); /* the error names where the value came from */
    setenv("BATON_THREADS", "", 1); /* empty counts as unset */
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){NULL}) == BT_OK && f.threads == 0);
    clear_env();
}

static void test_errors(void)
{
    clear_env();
    static const struct {
        const char *args[5];
        const char *says;
    } cases[] = {
        {{"--bogus", NULL}, "unknown option '--bogus'"},
        {{"--model", "m", "--threads", NULL}, "--threads needs a value"},
        {{"--model", "m", "--threads", "1025", NULL}, "--threads"},
        {{"--model", "m", "--max-batch-tokens", "8", NULL}, "--max-batch-tokens"},
        {{"--model", "m", "--grace-ms", "-5", NULL}, "--grace-ms"},
        {{"--model", "m", "--log-level", "loud", NULL}, "--log-level"},
        {{"--model", "m", "--cluster", "a/b", NULL}, "--cluster"},
        {{"--model", "m", "--node-id", "a b", NULL}, "--node-id"},
        {{"--model", "m", "--node-id=", NULL}, "empty"},
        {{"--model", "m", "--grpc-listen", "nohost", NULL}, "--grpc-listen"},
        {{"--model", "m", "--http-listen", "h:99999", NULL}, "--http-listen"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bt_node_flags_t f;
        memset(&f, 0x5a, sizeof f);
        int help = 0;
        bt_status st = parse(&f, MBR_ROLE_DECODE, &help, cases[i].args);
        CHECK_MSG(st == BT_ERR_INVALID, "case %zu gave %d", i, st);
        CHECK_MSG(strstr(bt_last_error(), cases[i].says) != NULL, "case %zu: '%s' lacks '%s'", i, bt_last_error(),
                  cases[i].says);
        CHECK_MSG(f.threads == 0x5a5a5a5a, "case %zu wrote the flags on failure", i);
    }
}

static void test_spec_flags(void)
{
    clear_env();
    bt_node_flags_t f;
    int help;
    REQUIRE(parse(&f, MBR_ROLE_DECODE, &help,
                  (const char *const[]){"--model", "m", "--spec", "self:8", "--spec-k-max", "16", NULL}) == BT_OK);
    CHECK(!strcmp(f.spec, "self:8") && f.spec_k_max == 16);
    REQUIRE(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--model", "m", NULL}) == BT_OK);
    CHECK(f.spec[0] == 0 && f.spec_k_max == 0);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--model", "m", "--spec-k-max", "17", NULL}) ==
          BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "--spec-k-max") != NULL);
    /* speculation is the decode node's: a prefill node refuses the flag but ignores a cluster-wide variable */
    CHECK(parse(&f, MBR_ROLE_PREFILL, &help, (const char *const[]){"--model", "m", "--spec", "ngram", NULL}) ==
          BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "decode nodes") != NULL);
    CHECK(parse(&f, MBR_ROLE_PREFILL, &help, (const char *const[]){"--model", "m", "--spec", "none", NULL}) == BT_OK);
    setenv("BATON_SPEC", "ngram", 1);
    REQUIRE(parse(&f, MBR_ROLE_PREFILL, &help, (const char *const[]){"--model", "m", NULL}) == BT_OK);
    CHECK(f.spec[0] == 0);
    REQUIRE(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--model", "m", NULL}) == BT_OK);
    CHECK(!strcmp(f.spec, "ngram"));
    clear_env();
}

static void test_help(void)
{
    clear_env();
    bt_node_flags_t f;
    int help = 0;
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--help", "--bogus", NULL}) == BT_OK && help == 1);
    help = 0;
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--model", "m", "-h", NULL}) == BT_OK && help == 1);
    help = 0;
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--bogus", "--help", NULL}) == BT_ERR_INVALID);
}

/* Issue 16 item 3: TLS and etcd credential flags; a non-loopback gRPC listener needs mTLS or --insecure; the etcd
 * password comes from a file and is never accepted on the command line. */
static void test_security_flags(void)
{
    clear_env();
    const char *dir = test_tmpdir();
    char cert[512], key[512], ca[512], pw[512];
    snprintf(cert, sizeof cert, "%s/n.pem", dir);
    snprintf(key, sizeof key, "%s/n-key.pem", dir);
    snprintf(ca, sizeof ca, "%s/ca.pem", dir);
    snprintf(pw, sizeof pw, "%s/pw", dir);
    const char *pem = "-----BEGIN CERTIFICATE-----\nAA\n-----END CERTIFICATE-----\n";
    const char *kpem = "-----BEGIN PRIVATE KEY-----\nAA\n-----END PRIVATE KEY-----\n";
    REQUIRE(test_write_file(cert, pem, strlen(pem)) == 0);
    REQUIRE(test_write_file(ca, pem, strlen(pem)) == 0);
    REQUIRE(test_write_file(key, kpem, strlen(kpem)) == 0);
    REQUIRE(test_write_file(pw, "hunter2\n", 8) == 0);
    bt_node_flags_t f;
    int help;
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--etcd", "none", NULL}) == BT_OK);
    CHECK(!f.tls.cert[0] && !f.insecure && !f.etcd_user[0]);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--grpc-listen", "0.0.0.0:0", NULL}) ==
          BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "mutual TLS") && strstr(bt_last_error(), "--insecure"), "%s", bt_last_error());
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--grpc-listen", "0.0.0.0:0", "--insecure", NULL}) ==
          BT_OK);
    CHECK(f.insecure == 1);
    CHECK(parse(&f, MBR_ROLE_PREFILL, &help,
                (const char *const[]){"--grpc-listen", "10.1.2.3:0", "--tls-cert", cert, "--tls-key", key, "--tls-ca",
                                      ca, NULL}) == BT_OK);
    CHECK(!strcmp(f.tls.cert, cert) && !strcmp(f.tls.key, key) && !strcmp(f.tls.ca, ca));
    CHECK(parse(&f, MBR_ROLE_PREFILL, &help,
                (const char *const[]){"--grpc-listen", "10.1.2.3:0", "--tls-cert", cert, "--tls-key", key, NULL}) ==
          BT_ERR_INVALID);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--tls-cert", cert, "--tls-key", ca, "--tls-ca", ca,
                                                                   NULL}) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--tls-key") && strstr(bt_last_error(), "PRIVATE KEY"), "%s", bt_last_error());
    setenv("BATON_INSECURE", "1", 1);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--grpc-listen", "0.0.0.0:0", NULL}) == BT_OK);
    setenv("BATON_INSECURE", "yes", 1);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){NULL}) == BT_ERR_INVALID);
    unsetenv("BATON_INSECURE");

    CHECK(parse(&f, MBR_ROLE_DECODE, &help,
                (const char *const[]){"--etcd-user", "baton", "--etcd-password-file", pw, "--etcd-ca", ca, NULL}) ==
          BT_OK);
    CHECK(!strcmp(f.etcd_user, "baton") && !strcmp(f.etcd_password, "hunter2") && !strcmp(f.etcd_tls.ca, ca));
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--etcd-user", "baton", NULL}) == BT_ERR_INVALID);
    CHECK(parse(&f, MBR_ROLE_DECODE, &help, (const char *const[]){"--etcd-password", "hunter2", NULL}) ==
          BT_ERR_INVALID); /* no flag takes a secret itself */
    CHECK(parse(&f, MBR_ROLE_DECODE, &help,
                (const char *const[]){"--etcd-user", "baton", "--etcd-password-file", "/nonexistent/pw", NULL}) ==
          BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "/nonexistent/pw"), "%s", bt_last_error());
    test_tmpdir_cleanup();
}

/* The switches without a flag, read once at the edge: defaults when unset, each value taken, a bad one refused with
 * the variable named and every field left at its default. */
static void test_engine_env(void)
{
    static const char *const vars[] = {"BATON_CPU_ISA", "BATON_ACT_BITS", "BATON_CPU_REPACK", "BATON_CPU_LANES",
                                       "BATON_PROFILE", "BATON_KVX_DATA_PATH", "BATON_SPEC_FIXED_K"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    bt_ne_env_t e;
    memset(&e, 0x5a, sizeof e);
    REQUIRE(bt_ne_env_read(&e) == BT_OK);
    CHECK(!e.cpu.force_isa && e.cpu.act_bits == 16 && !e.cpu.no_repack && !e.cpu.no_lanes);
    CHECK(e.profile == 0 && e.kvx_path == KVX_PATH_AUTO && e.spec_fixed_k == 0);
    setenv("BATON_CPU_ISA", "scalar", 1);
    setenv("BATON_ACT_BITS", "8", 1);
    setenv("BATON_CPU_REPACK", "0", 1);
    setenv("BATON_CPU_LANES", "0", 1);
    setenv("BATON_PROFILE", "1", 1);
    setenv("BATON_KVX_DATA_PATH", "put", 1);
    setenv("BATON_SPEC_FIXED_K", "1", 1);
    REQUIRE(bt_ne_env_read(&e) == BT_OK);
    CHECK(e.cpu.force_isa && e.cpu.isa == 0 && e.cpu.act_bits == 8 && e.cpu.no_repack && e.cpu.no_lanes);
    CHECK(e.profile == 1 && e.kvx_path == KVX_PATH_PUT && e.spec_fixed_k == 1);
    static const char *const bad[][2] = {{"BATON_CPU_ISA", "sse"},    {"BATON_ACT_BITS", "4"},
                                         {"BATON_CPU_REPACK", "yes"}, {"BATON_CPU_LANES", "2"},
                                         {"BATON_PROFILE", "on"},     {"BATON_KVX_DATA_PATH", "rdma"},
                                         {"BATON_SPEC_FIXED_K", "yes"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (size_t j = 0; j < sizeof vars / sizeof vars[0]; j++) unsetenv(vars[j]);
        setenv(bad[i][0], bad[i][1], 1);
        memset(&e, 0x5a, sizeof e);
        CHECK_MSG(bt_ne_env_read(&e) == BT_ERR_INVALID, "%s=%s", bad[i][0], bad[i][1]);
        CHECK_MSG(strstr(bt_last_error(), bad[i][0]) && strstr(bt_last_error(), bad[i][1]), "%s", bt_last_error());
        CHECK(!e.cpu.force_isa && e.cpu.act_bits == 0 && e.profile == 0 && e.kvx_path == KVX_PATH_AUTO &&
              !e.spec_fixed_k);
    }
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

int main(void)
{
    RUN(test_split_addr_accepts);
    RUN(test_split_addr_refuses);
    RUN(test_defaults);
    RUN(test_flags_and_forms);
    RUN(test_sizes);
    RUN(test_environment_fallback);
    RUN(test_errors);
    RUN(test_spec_flags);
    RUN(test_help);
    RUN(test_security_flags);
    RUN(test_engine_env);
    return test_summary();
}
