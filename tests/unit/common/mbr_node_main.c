/* A stand-in node process for the membership tests: registers under a lease, publishes load reports, and prints
 * every registration state change as "STATE <state> <lease>" on stdout. SIGTERM deregisters and exits.
 * Usage: test_mbr_node <endpoints> <cluster> <node_id> <ttl_s> <load_hz> */
#include "common/membership.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static void on_state(void *arg, mbr_reg_state state, int64_t lease)
{
    (void)arg;
    printf("STATE %d %lld\n", (int)state, (long long)lease);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s endpoints cluster node_id ttl_s load_hz\n", argv[0]);
        return 2;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    etcd_config_t ecfg = {.endpoints = argv[1]};
    etcd_client_t *c;
    if (etcd_client_create(&ecfg, &c)) {
        fprintf(stderr, "%s\n", bt_last_error());
        return 1;
    }
    mbr_node_info_t info = {.role = MBR_ROLE_DECODE, .kv_blocks_total = 1000, .kv_block_tokens = 16,
                            .max_running = 64, .max_context = 4096, .started_ms = (int64_t)time(NULL) * 1000};
    snprintf(info.node_id, sizeof info.node_id, "%s", argv[3]);
    snprintf(info.model, sizeof info.model, "test-model");
    snprintf(info.grpc_addr, sizeof info.grpc_addr, "127.0.0.1:%d", 40000 + (int)(getpid() % 20000));
    snprintf(info.version, sizeof info.version, "test");
    uint8_t desc[40];
    for (size_t i = 0; i < sizeof desc; i++) desc[i] = (uint8_t)(i * 7);
    info.ucx_desc = desc;
    info.ucx_desc_len = sizeof desc;
    mbr_config_t cfg = {.cluster = argv[2], .ttl_s = atoi(argv[4]), .on_state = on_state};
    mbr_registration_t *r;
    if (mbr_registration_create(c, &cfg, &info, &r)) {
        fprintf(stderr, "%s\n", bt_last_error());
        etcd_client_destroy(c);
        return 1;
    }
    int hz = atoi(argv[5]);
    unsigned seed = (unsigned)getpid();
    mbr_load_report_t load = {.kv_blocks_total = 1000, .kv_blocks_free = 1000};
    while (!stop_requested) {
        if (hz > 0) {
            load.running_seqs = rand_r(&seed) % 64;
            load.queued_requests = rand_r(&seed) % 10;
            load.kv_blocks_free = rand_r(&seed) % 1000;
            load.decode_tok_s = 100.0 + rand_r(&seed) % 1000;
            mbr_registration_publish_load(r, &load);
            usleep((useconds_t)(1000000 / hz));
        } else {
            usleep(100000);
        }
    }
    mbr_registration_destroy(r, 1);
    etcd_client_destroy(c);
    return 0;
}
