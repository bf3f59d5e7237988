/* baton status codes and the per-thread error message.
 * Libraries return bt_status (negative = error); the function that decides an error calls bt_fail() with a
 * precise message, callers propagate the code, and whoever reports it (main, an RPC handler) reads
 * bt_last_error() once. */
#ifndef BATON_COMMON_STATUS_H
#define BATON_COMMON_STATUS_H

#include <stddef.h>

typedef enum bt_status {
    BT_OK = 0,
    BT_ERR_INVALID = -1,     /* bad argument or malformed input from a caller or client */
    BT_ERR_NOMEM = -2,       /* allocation failed */
    BT_ERR_IO = -3,          /* file or socket I/O failed */
    BT_ERR_FORMAT = -4,      /* a file or message is malformed */
    BT_ERR_UNSUPPORTED = -5, /* valid but not supported (architecture, weight type, option) */
    BT_ERR_NOT_FOUND = -6,   /* a key, file, node or request does not exist */
    BT_ERR_TIMEOUT = -7,     /* a deadline passed */
    BT_ERR_PEER = -8,        /* a remote peer failed or vanished */
    BT_ERR_EXHAUSTED = -9,   /* a pool, queue or limit is full */
    BT_ERR_CANCELLED = -10,  /* aborted on request */
    BT_ERR_STALE = -11,      /* an epoch or revision is out of date */
    BT_ERR_UNAVAILABLE = -12, /* a dependency (etcd, a node role) cannot be reached */
    BT_ERR_INTERNAL = -13,   /* a bug: an invariant did not hold */
} bt_status;

/* Short fixed name of a status ("invalid argument"); never NULL. */
const char *bt_status_str(bt_status st);

/* Records a printf-style message for this thread and returns st unchanged, so `return bt_fail(...)` works.
 * Can't fail; long messages are truncated. */
bt_status bt_fail(bt_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The message recorded by the last bt_fail() on this thread, or "" if none. Valid until the next bt_fail(). */
const char *bt_last_error(void);

/* Clears this thread's message. */
void bt_clear_error(void);

#endif
