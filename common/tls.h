/* TLS settings shared by every baton process: the --tls-* and --etcd-* flags, the files they name checked at
 * start-up with one precise error, secrets read from files (never argv), the loopback rule for insecure internal
 * listeners, and the shape of member addresses read from etcd. No TLS library is linked here: gRPC (common/rpc.c),
 * libcurl (common/etcd.c) and libmicrohttpd (common/http.c) do the handshakes.
 *
 * Identity: a baton process's certificate names its node id as a DNS subject alternative name (the local cluster
 * and tests make them so). A router or decode node dialling a member sets that member's node id as the name the
 * server's certificate must match, so a record that points at a host holding another identity is refused at the
 * handshake (DESIGN 8; issue 16 item 4). */
#ifndef BATON_COMMON_TLS_H
#define BATON_COMMON_TLS_H

#include "common/status.h"

#include <stddef.h>

#define BT_TLS_PATH_MAX 4096
#define BT_TLS_SECRET_MAX 1024

/* Paths of PEM files; "" = not set. */
typedef struct bt_tls_files {
    char cert[BT_TLS_PATH_MAX]; /* certificate chain of this process */
    char key[BT_TLS_PATH_MAX];  /* its private key */
    char ca[BT_TLS_PATH_MAX];   /* CA bundle peers' certificates must chain to */
} bt_tls_files_t;

/* Fills the TLS part of an etcd client config from t: each path, or NULL where "" (the strings stay t's). */
void bt_tls_etcd_paths(const bt_tls_files_t *t, const char **ca_file, const char **cert_file, const char **key_file);

/* 1 when cert, key and ca are all set (mutual TLS between baton processes). Can't fail. */
int bt_tls_mutual(const bt_tls_files_t *t);

/* Checks the set: cert and key come together; ca alone is allowed only when allow_ca_only (a client that verifies
 * servers without a certificate of its own); each file is readable and holds the PEM block its role needs
 * (CERTIFICATE for cert and ca, a PRIVATE KEY for key). what names the flag family in messages ("--tls").
 * Returns BT_ERR_INVALID with a message naming the flag, the file and the fault. Reads files; can't block long. */
bt_status bt_tls_files_check(const bt_tls_files_t *t, const char *what, int allow_ca_only);

/* Reads the whole file (at most 1 MiB) into a new NUL-terminated buffer the caller frees. BT_ERR_INVALID naming
 * what and the file (missing, unreadable, too large), BT_ERR_NOMEM. */
bt_status bt_tls_load_file(const char *what, const char *path, char **out);

/* Reads a secret (a password) from path: the first line, trailing CR/LF removed, into out[cap]. Returns
 * BT_ERR_INVALID naming what and the file (missing, unreadable, empty, longer than cap - 1). */
bt_status bt_tls_read_secret(const char *what, const char *path, char *out, size_t cap);

/* 1 when host (no port, no brackets) is a loopback address or "localhost"; 0 otherwise (wildcards included). */
int bt_tls_host_is_loopback(const char *host);

/* The rule for internal APIs: a listener on a host other than loopback needs mutual TLS unless insecure is set.
 * listen is "host:port" or "[v6]:port"; flag names the listener in the message ("--grpc-listen"). Returns
 * BT_ERR_INVALID with a message that names the remedies (--tls-cert/--tls-key/--tls-ca or --insecure). */
bt_status bt_tls_check_listen(const char *flag, const char *listen, const bt_tls_files_t *t, int insecure);

/* Checks an address read from an untrusted source (an etcd member record, a prefill hint): "host:port" or
 * "[v6]:port", host made of letters, digits, '.', '-' (or hex and ':' inside brackets), port 1..65535, nothing
 * else (no scheme, no path, no "unix:" target). BT_ERR_INVALID with the address escaped in the message. */
bt_status bt_tls_check_member_addr(const char *addr);

#endif
