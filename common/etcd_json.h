/* Internal to common/etcd: parsers of the JSON gateway's answers, kept apart so the fuzz target
 * (tests/fuzz/fuzz_etcd_response.c) can drive them without a network. Every parser takes a body of len bytes
 * (not NUL-terminated), never reads past it, returns BT_ERR_FORMAT for bad JSON, wrong types or bad base64,
 * BT_ERR_NOMEM, and sets its outputs only on success. int64 fields are accepted as JSON strings (what the
 * gateway sends) or integral numbers; absent fields mean 0 (the gateway omits zero values). */
#ifndef BATON_COMMON_ETCD_JSON_H
#define BATON_COMMON_ETCD_JSON_H

#include "common/etcd.h"

/* {"error","message","code"}: code and message (truncated to msg_cap) of a gateway error answer. */
bt_status etcd_json_parse_error(const char *body, size_t len, int *code, char *msg, size_t msg_cap);

/* Range answer. */
bt_status etcd_json_parse_range(const char *body, size_t len, etcd_range_result_t *out);

/* Any answer with a header: the store revision (put, revoke). */
bt_status etcd_json_parse_revision(const char *body, size_t len, int64_t *revision);

/* DeleteRange answer. */
bt_status etcd_json_parse_delete(const char *body, size_t len, int64_t *deleted, int64_t *revision);

/* Txn answer. */
bt_status etcd_json_parse_txn(const char *body, size_t len, int *succeeded, int64_t *revision);

/* Lease grant / timetolive ({ID, TTL, grantedTTL}) or, with in_result, keepalive ({"result":{ID, TTL}}).
 * Missing TTL reads as 0; granted may be NULL. */
bt_status etcd_json_parse_lease(const char *body, size_t len, int in_result, int64_t *id, int64_t *ttl,
                                int64_t *granted);

/* Authenticate answer: the token, a new string owned by the caller. */
bt_status etcd_json_parse_token(const char *body, size_t len, char **token);

/* One line of a watch stream. */
typedef struct etcd_watch_msg {
    int is_error;        /* the gateway reported a stream error ({"error":...}) */
    int created;
    int canceled;
    int64_t revision;    /* header revision */
    int64_t compact_revision;
    char reason[256];    /* cancel_reason or error message */
    etcd_event_t *events;
    size_t n_events;
} etcd_watch_msg_t;

bt_status etcd_json_parse_watch(const char *body, size_t len, etcd_watch_msg_t *out);
void etcd_watch_msg_free(etcd_watch_msg_t *m);

/* The watch stream splitter: the gateway streams one JSON object per line, cut into chunks anywhere. Bytes are
 * kept until their line is complete; each complete line (without its '\n') goes to on_line in order. */
typedef struct etcd_lines {
    char *data;   /* the incomplete last line */
    size_t len, cap;
    size_t limit; /* longest line accepted, bytes */
} etcd_lines_t;

/* Feeds n bytes. Returns BT_ERR_EXHAUSTED (a line longer than limit), BT_ERR_CANCELLED (on_line returned nonzero;
 * the rest of the chunk is not read) or BT_ERR_NOMEM; after an error the splitter must be reset. */
bt_status etcd_lines_feed(etcd_lines_t *s, const char *p, size_t n, int (*on_line)(void *ud, const char *line, size_t len),
                          void *ud);

/* Drops what is buffered (a new stream starts). */
void etcd_lines_reset(etcd_lines_t *s);

/* Frees the buffer and zeroes the splitter (limit included). */
void etcd_lines_free(etcd_lines_t *s);

/* Frees what a kv owns and zeroes it. */
void etcd_kv_free(etcd_kv_t *kv);

#endif
