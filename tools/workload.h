/* Workload files (the JSON-lines files in tools/workloads) read by `baton bench --spec` and `baton bench-serve
 * --workload`: one JSON object per line with a string "chat" (a user message) or "prompt" (raw text) and an optional
 * "name"; blank lines are skipped. */
#ifndef BATON_TOOLS_WORKLOAD_H
#define BATON_TOOLS_WORKLOAD_H

typedef struct workload_item {
    char name[64];
    char *text; /* owned */
    int chat;   /* 1: "chat" (render it with a chat template), 0: "prompt" */
} workload_item;

/* Reads path into *out (n items, at most max). On error prints one line "<prog>: <path>[:<line>]: <why>" to stderr
 * and returns -1 with nothing allocated; an empty file is an error. */
int workload_load(const char *prog, const char *path, int max, workload_item **out, int *n);

/* NULL allowed. */
void workload_free(workload_item *w, int n);

#endif
