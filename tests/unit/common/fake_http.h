/* A tiny HTTP/1.1 server thread on 127.0.0.1 for tests that need answers a real server never gives
 * (HTTP 500, truncated JSON, wrong types, huge bodies, no answer at all). Every connection gets the same
 * canned answer, then is closed. */
#ifndef BATON_TESTS_FAKE_HTTP_H
#define BATON_TESTS_FAKE_HTTP_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

typedef struct fake_http {
    int listen_fd;
    int port;
    pthread_t thread;
    atomic_int stop;
    pthread_mutex_t mu;
    int status;          /* HTTP status of the answer */
    char *body;          /* answer body (owned) */
    size_t body_len;
    size_t huge_len;     /* > 0: send this many bytes of '[' padding instead of body */
    atomic_int hang;     /* 1: read the request and never answer */
    int requests;        /* requests served */
} fake_http_t;

/* Starts the server; 0 on success. */
int fake_http_start(fake_http_t *f);
/* Sets the next answers (body copied). */
void fake_http_set(fake_http_t *f, int status, const char *body);
void fake_http_set_huge(fake_http_t *f, size_t len);
void fake_http_set_hang(fake_http_t *f, int hang);
void fake_http_stop(fake_http_t *f);

#endif
