/* TLS settings: file checks, secrets, the loopback rule, member address shape (see tls.h). */
#include "common/tls.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TLS_MAX_PEM (1u << 20)

int bt_tls_mutual(const bt_tls_files_t *t)
{
    return t && t->cert[0] && t->key[0] && t->ca[0];
}

bt_status bt_tls_load_file(const char *flag, const char *path, char **out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return bt_fail(BT_ERR_INVALID, "%s %s: cannot open: %s", flag, path, strerror(errno));
    char *buf = malloc(TLS_MAX_PEM + 1);
    if (!buf) {
        fclose(f);
        return bt_fail(BT_ERR_NOMEM, "out of memory reading %s", path);
    }
    size_t n = fread(buf, 1, TLS_MAX_PEM + 1, f);
    int err = ferror(f);
    fclose(f);
    if (err || n > TLS_MAX_PEM) {
        free(buf);
        return bt_fail(BT_ERR_INVALID, "%s %s: %s", flag, path, err ? "read error" : "larger than 1 MiB");
    }
    buf[n] = 0;
    *out = buf;
    return BT_OK;
}

/* The file holds a PEM block whose label ends with label ("CERTIFICATE", "PRIVATE KEY"). */
static bt_status check_pem(const char *flag, const char *path, const char *label)
{
    char *buf = NULL;
    bt_status st = bt_tls_load_file(flag, path, &buf);
    if (st) return st;
    int found = 0;
    for (const char *p = strstr(buf, "-----BEGIN "); p && !found; p = strstr(p + 1, "-----BEGIN ")) {
        const char *end = strstr(p + 11, "-----");
        size_t ll = strlen(label);
        if (end && (size_t)(end - (p + 11)) >= ll && !strncmp(end - ll, label, ll)) found = 1;
    }
    free(buf);
    if (!found) return bt_fail(BT_ERR_INVALID, "%s %s: no PEM %s block in the file", flag, path, label);
    return BT_OK;
}

bt_status bt_tls_files_check(const bt_tls_files_t *t, const char *what, int allow_ca_only)
{
    char f_cert[64], f_key[64], f_ca[64];
    snprintf(f_cert, sizeof f_cert, "%s-cert", what);
    snprintf(f_key, sizeof f_key, "%s-key", what);
    snprintf(f_ca, sizeof f_ca, "%s-ca", what);
    if (!t->cert[0] && !t->key[0] && !t->ca[0]) return BT_OK;
    if (!t->cert[0] != !t->key[0])
        return bt_fail(BT_ERR_INVALID, "%s needs %s as well", t->cert[0] ? f_cert : f_key, t->cert[0] ? f_key : f_cert);
    if (!t->cert[0] && !allow_ca_only)
        return bt_fail(BT_ERR_INVALID, "%s needs %s and %s as well", f_ca, f_cert, f_key);
    bt_status st;
    if (t->cert[0] && (st = check_pem(f_cert, t->cert, "CERTIFICATE"))) return st;
    if (t->key[0] && (st = check_pem(f_key, t->key, "PRIVATE KEY"))) return st;
    if (t->ca[0] && (st = check_pem(f_ca, t->ca, "CERTIFICATE"))) return st;
    return BT_OK;
}

bt_status bt_tls_read_secret(const char *what, const char *path, char *out, size_t cap)
{
    char *buf = NULL;
    bt_status st = bt_tls_load_file(what, path, &buf);
    if (st) return st;
    size_t n = strcspn(buf, "\r\n");
    if (n == 0) st = bt_fail(BT_ERR_INVALID, "%s %s: the first line is empty", what, path);
    else if (n >= cap) st = bt_fail(BT_ERR_INVALID, "%s %s: longer than %zu bytes", what, path, cap - 1);
    else {
        memcpy(out, buf, n);
        out[n] = 0;
    }
    memset(buf, 0, strlen(buf)); /* the secret should not linger in freed memory */
    free(buf);
    return st;
}

int bt_tls_host_is_loopback(const char *host)
{
    if (!host) return 0;
    if (!strcmp(host, "localhost") || !strcmp(host, "::1")) return 1;
    if (strncmp(host, "127.", 4)) return 0;
    for (const char *p = host + 4; *p; p++)
        if (!isdigit((unsigned char)*p) && *p != '.') return 0;
    return 1;
}

/* Host part of "host:port" / "[v6]:port" into host[cap]; BT_ERR_INVALID when there is no port separator. */
static bt_status split_host(const char *addr, char *host, size_t cap, const char **port)
{
    const char *h = addr, *colon;
    size_t hl;
    if (addr[0] == '[') {
        const char *rb = strchr(addr, ']');
        if (!rb || rb[1] != ':') return BT_ERR_INVALID;
        h = addr + 1;
        hl = (size_t)(rb - h);
        colon = rb + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon) return BT_ERR_INVALID;
        hl = (size_t)(colon - addr);
    }
    if (hl == 0 || hl >= cap) return BT_ERR_INVALID;
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = colon + 1;
    return BT_OK;
}

bt_status bt_tls_check_listen(const char *flag, const char *listen, const bt_tls_files_t *t, int insecure)
{
    char host[256];
    const char *port;
    if (!listen || split_host(listen, host, sizeof host, &port))
        return bt_fail(BT_ERR_INVALID, "%s: bad address '%s' (expected host:port)", flag, listen ? listen : "");
    if (insecure || bt_tls_host_is_loopback(host) || bt_tls_mutual(t)) return BT_OK;
    return bt_fail(BT_ERR_INVALID,
                   "%s %s: an internal API on a non-loopback address needs mutual TLS (--tls-cert, --tls-key and "
                   "--tls-ca); pass --insecure to serve it without authentication anyway",
                   flag, listen);
}

/* addr with anything but printable ASCII escaped, for messages about untrusted input. */
static void escape(const char *s, char *out, size_t cap)
{
    size_t o = 0;
    for (; *s && o + 5 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c < 0x7f && c != '\\') out[o++] = (char)c;
        else o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    out[o] = 0;
}

bt_status bt_tls_check_member_addr(const char *addr)
{
    char host[256], shown[160];
    const char *port;
    escape(addr ? addr : "", shown, sizeof shown);
    if (!addr || strlen(addr) > 255 || split_host(addr, host, sizeof host, &port))
        return bt_fail(BT_ERR_INVALID, "member address '%s' is not host:port", shown);
    int v6 = addr[0] == '[';
    for (const char *p = host; *p; p++) {
        unsigned char c = (unsigned char)*p;
        int ok = v6 ? (isxdigit(c) || c == ':' || c == '.') : (isalnum(c) || c == '.' || c == '-');
        if (!ok) return bt_fail(BT_ERR_INVALID, "member address '%s': bad character in the host", shown);
    }
    if (host[0] == '-' || host[0] == '.')
        return bt_fail(BT_ERR_INVALID, "member address '%s': bad host", shown);
    char *end;
    errno = 0;
    long p = strtol(port, &end, 10);
    if (!isdigit((unsigned char)*port) || *end || errno || p < 1 || p > 65535)
        return bt_fail(BT_ERR_INVALID, "member address '%s': port must be 1..65535", shown);
    return BT_OK;
}

void bt_tls_etcd_paths(const bt_tls_files_t *t, const char **ca_file, const char **cert_file, const char **key_file)
{
    *ca_file = t->ca[0] ? t->ca : NULL;
    *cert_file = t->cert[0] ? t->cert : NULL;
    *key_file = t->key[0] ? t->key : NULL;
}
