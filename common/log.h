/* Leveled logging to stderr: "2026-11-29T09:50:00.123Z INFO  component: message".
 * The threshold comes from BATON_LOG (debug|info|warn|error, default info), read once on first use.
 * Thread-safe: each line is written with one fwrite. Can't fail. */
#ifndef BATON_COMMON_LOG_H
#define BATON_COMMON_LOG_H

typedef enum bt_log_level {
    BT_LOG_DEBUG = 0,
    BT_LOG_INFO = 1,
    BT_LOG_WARN = 2,
    BT_LOG_ERROR = 3,
} bt_log_level;

void bt_log(bt_log_level level, const char *component, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Overrides BATON_LOG (used by --verbose / --quiet flags). */
void bt_log_set_level(bt_log_level level);

/* True when messages at this level are printed: lets callers skip building expensive debug text. */
int bt_log_enabled(bt_log_level level);

#define BT_DEBUG(comp, ...) bt_log(BT_LOG_DEBUG, comp, __VA_ARGS__)
#define BT_INFO(comp, ...) bt_log(BT_LOG_INFO, comp, __VA_ARGS__)
#define BT_WARN(comp, ...) bt_log(BT_LOG_WARN, comp, __VA_ARGS__)
#define BT_ERROR(comp, ...) bt_log(BT_LOG_ERROR, comp, __VA_ARGS__)

#endif
