/* Throwaway etcd servers for tests: `etcd` from Debian's etcd-server on random free loopback ports with a
 * temporary data directory, stopped by pid. Used by the etcd and membership tests and by any later C test
 * that needs a real etcd (link the baton_etcd_harness target). */
#ifndef BATON_TESTS_ETCD_HARNESS_H
#define BATON_TESTS_ETCD_HARNESS_H

#include "common/status.h"

#include <sys/types.h>

typedef struct etcd_harness {
    pid_t pid;              /* 0 while stopped */
    int client_port;
    int peer_port;
    char dir[256];          /* temporary directory: data/ and etcd.log */
    int metrics_port;       /* plain-HTTP /health, also when the client port speaks TLS */
    char endpoint[64];      /* "http://127.0.0.1:<client_port>" ("https://" when extra_args has --cert-file) */
    char extra_args[1024];  /* extra etcd flags, space-separated (e.g. "--auth-token-ttl=2") */
} etcd_harness_t;

/* Starts etcd (binary: $BATON_ETCD_BIN or "etcd" on PATH) in a new temporary directory and waits until its
 * /health answers (up to 20 s). extra_args may be NULL; with --cert-file in it the client URL is https. Retries on fresh ports when etcd fails to bind.
 * Returns BT_ERR_UNAVAILABLE (etcd missing or never healthy; its log is printed to stderr). */
bt_status etcd_harness_start(etcd_harness_t *h, const char *extra_args);

/* Starts etcd again on the same ports and data directory after a stop or kill; waits until healthy. */
bt_status etcd_harness_restart(etcd_harness_t *h);

/* SIGTERM and wait (SIGKILL after 5 s). No-op when stopped. */
void etcd_harness_stop(etcd_harness_t *h);

/* SIGKILL and wait: a crash. No-op when stopped. */
void etcd_harness_kill(etcd_harness_t *h);

/* Stops etcd and removes the temporary directory. */
void etcd_harness_destroy(etcd_harness_t *h);

/* Creates user root with password, grants it the root role and enables authentication (runs etcdctl). */
bt_status etcd_harness_enable_auth(etcd_harness_t *h, const char *root_password);

/* Picks a free TCP port on 127.0.0.1 (bind to port 0 and close); 0 on failure. Others may take it meanwhile. */
int etcd_harness_free_port(void);

#endif
