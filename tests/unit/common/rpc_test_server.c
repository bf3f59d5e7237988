/* rpc_test_server: the test Generation service (rpc_test_service.c) on a gRPC port, for
 * tests/integration/test_rpc_python.py. Prints "PORT <n>" once serving; SIGTERM or SIGINT shuts it down
 * cleanly (grace 1 s), prints "STATS cancelled=C finished=F" and exits 0.
 * Usage: rpc_test_server [--listen ADDR] [--threads N] [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]] */
#include "common/rpc.h"
#include "rpc_test_service.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    bt_rpc_server_config_t cfg = {.listen = "127.0.0.1:0"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "missing value for %s\n", a);
            return 2;
        }
        if (strcmp(a, "--listen") == 0) cfg.listen = v;
        else if (strcmp(a, "--threads") == 0) cfg.n_threads = atoi(v);
        else if (strcmp(a, "--tls-cert") == 0) cfg.tls_cert_file = v;
        else if (strcmp(a, "--tls-key") == 0) cfg.tls_key_file = v;
        else if (strcmp(a, "--tls-client-ca") == 0) cfg.tls_client_ca_file = v;
        else {
            fprintf(stderr, "unknown flag %s\n", a);
            return 2;
        }
        i++;
    }
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* before any thread starts: every thread inherits the mask */

    rpc_test_svc svc;
    rpc_test_svc_init(&svc);
    bt_rpc_server_t *srv = NULL;
    bt_status st = bt_rpc_server_create(&cfg, &srv);
    if (st == BT_OK) st = rpc_test_svc_register(&svc, srv);
    if (st == BT_OK) st = bt_rpc_server_start(srv);
    if (st != BT_OK) {
        fprintf(stderr, "rpc_test_server: %s\n", bt_last_error());
        bt_rpc_server_destroy(srv);
        return 1;
    }
    printf("PORT %d\n", bt_rpc_server_port(srv));
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    bt_rpc_server_shutdown(srv, 1000);
    bt_rpc_server_destroy(srv);
    int idle = rpc_test_svc_wait_idle(&svc, 5000);
    printf("STATS cancelled=%d finished=%d idle=%d\n", atomic_load(&svc.cancelled), atomic_load(&svc.finished), idle);
    fflush(stdout);
    rpc_test_svc_destroy(&svc);
    return idle ? 0 : 1;
}
