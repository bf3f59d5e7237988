/* Tests common/tls: the checks every process runs on its --tls-* and --etcd-* files at start-up, secrets from files,
 * the loopback rule for internal listeners, and the shape of member addresses from etcd. */
#include "common/tls.h"
#include "test_util.h"

#include <stdio.h>
#include <string.h>

static const char CERT[] = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
static const char KEY[] = "-----BEGIN EC PRIVATE KEY-----\nMHc\n-----END EC PRIVATE KEY-----\n";

static void path(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", test_tmpdir(), name);
}

static void test_files_check(void)
{
    bt_tls_files_t t;
    memset(&t, 0, sizeof t);
    CHECK(bt_tls_files_check(&t, "--tls", 0) == BT_OK); /* nothing set: TLS off */
    path(t.cert, sizeof t.cert, "c.pem");
    path(t.key, sizeof t.key, "k.pem");
    path(t.ca, sizeof t.ca, "ca.pem");
    REQUIRE(test_write_file(t.cert, CERT, strlen(CERT)) == 0);
    REQUIRE(test_write_file(t.key, KEY, strlen(KEY)) == 0);
    REQUIRE(test_write_file(t.ca, CERT, strlen(CERT)) == 0);
    CHECK(bt_tls_files_check(&t, "--tls", 0) == BT_OK);
    CHECK(bt_tls_mutual(&t));

    bt_tls_files_t u = t;
    path(u.cert, sizeof u.cert, "missing.pem");
    CHECK(bt_tls_files_check(&u, "--tls", 0) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--tls-cert") && strstr(bt_last_error(), "missing.pem") &&
                  strstr(bt_last_error(), "No such file"),
              "%s", bt_last_error());
    u = t;
    snprintf(u.key, sizeof u.key, "%s", t.cert); /* a certificate given as the key */
    CHECK(bt_tls_files_check(&u, "--tls", 0) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--tls-key") && strstr(bt_last_error(), "no PEM PRIVATE KEY"), "%s",
              bt_last_error());
    u = t;
    snprintf(u.ca, sizeof u.ca, "%s", t.key);
    CHECK(bt_tls_files_check(&u, "--etcd", 0) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--etcd-ca") && strstr(bt_last_error(), "no PEM CERTIFICATE"), "%s",
              bt_last_error());
    u = t;
    u.key[0] = 0;
    CHECK(bt_tls_files_check(&u, "--tls", 0) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--tls-cert needs --tls-key"), "%s", bt_last_error());
    u = t;
    u.cert[0] = u.key[0] = 0;
    CHECK(bt_tls_files_check(&u, "--tls", 0) == BT_ERR_INVALID); /* CA alone: not for a server */
    CHECK(bt_tls_files_check(&u, "--tls", 1) == BT_OK);          /* but fine for a client */
    CHECK(!bt_tls_mutual(&u));
}

static void test_secret(void)
{
    char p[512], out[64];
    path(p, sizeof p, "pw");
    REQUIRE(test_write_file(p, "s3cret\r\nignored\n", 16) == 0);
    CHECK(bt_tls_read_secret("--etcd-password-file", p, out, sizeof out) == BT_OK);
    CHECK(!strcmp(out, "s3cret"));
    REQUIRE(test_write_file(p, "\n", 1) == 0);
    CHECK(bt_tls_read_secret("--etcd-password-file", p, out, sizeof out) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "empty"), "%s", bt_last_error());
    char big[100];
    memset(big, 'x', sizeof big);
    REQUIRE(test_write_file(p, big, sizeof big) == 0);
    CHECK(bt_tls_read_secret("--etcd-password-file", p, out, sizeof out) == BT_ERR_INVALID);
    path(p, sizeof p, "nope");
    CHECK(bt_tls_read_secret("--etcd-password-file", p, out, sizeof out) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--etcd-password-file") && strstr(bt_last_error(), "nope"), "%s",
              bt_last_error());
}

static void test_listen_rule(void)
{
    bt_tls_files_t none, m;
    memset(&none, 0, sizeof none);
    memset(&m, 0, sizeof m);
    snprintf(m.cert, sizeof m.cert, "c");
    snprintf(m.key, sizeof m.key, "k");
    snprintf(m.ca, sizeof m.ca, "a");
    CHECK(bt_tls_check_listen("--grpc-listen", "127.0.0.1:0", &none, 0) == BT_OK);
    CHECK(bt_tls_check_listen("--grpc-listen", "127.1.2.3:5", &none, 0) == BT_OK);
    CHECK(bt_tls_check_listen("--grpc-listen", "[::1]:0", &none, 0) == BT_OK);
    CHECK(bt_tls_check_listen("--grpc-listen", "localhost:0", &none, 0) == BT_OK);
    CHECK(bt_tls_check_listen("--grpc-listen", "0.0.0.0:0", &none, 0) == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), "--insecure") && strstr(bt_last_error(), "0.0.0.0:0"), "%s", bt_last_error());
    CHECK(bt_tls_check_listen("--grpc-listen", "10.0.0.2:50051", &none, 0) == BT_ERR_INVALID);
    CHECK(bt_tls_check_listen("--grpc-listen", "[::]:1", &none, 0) == BT_ERR_INVALID);
    CHECK(bt_tls_check_listen("--grpc-listen", "127.0.0.1.evil.com:1", &none, 0) == BT_ERR_INVALID);
    CHECK(bt_tls_check_listen("--grpc-listen", "10.0.0.2:50051", &none, 1) == BT_OK);
    CHECK(bt_tls_check_listen("--grpc-listen", "10.0.0.2:50051", &m, 0) == BT_OK);
}

static void test_member_addr(void)
{
    const char *good[] = {"10.0.0.2:50051", "decode-1.cluster.local:1", "[fe80::1]:65535", "h:1"};
    const char *bad[] = {"",          "nohost",         ":1",         "h:",      "h:0",          "h:65536",
                         "h:1x",      "h:+1",           "unix:/x:1",  "a/b:1",   "a b:1",        "[::1]x:1",
                         "[g::1]:1",  "ipv4:1.2.3.4:1", "-h:1",       "h:1\n",   "dns:///h:1",   "h%00:1"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        CHECK_MSG(bt_tls_check_member_addr(good[i]) == BT_OK, "refused '%s': %s", good[i], bt_last_error());
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(bt_tls_check_member_addr(bad[i]) == BT_ERR_INVALID, "accepted '%s'", bad[i]);
    CHECK(bt_tls_check_member_addr("h\x1b[31m:1") == BT_ERR_INVALID);
    CHECK_MSG(!strchr(bt_last_error(), '\x1b'), "control byte echoed: %s", bt_last_error());
}

int main(void)
{
    RUN(test_files_check);
    RUN(test_secret);
    RUN(test_listen_rule);
    RUN(test_member_addr);
    test_tmpdir_cleanup();
    return test_summary();
}
