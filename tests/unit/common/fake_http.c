#define _GNU_SOURCE /* strcasestr */
#include "fake_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void serve(fake_http_t *f, int fd)
{
    char req[65536];
    size_t n = 0;
    for (;;) { /* read headers and the Content-Length body */
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 2000) <= 0) return;
        ssize_t r = recv(fd, req + n, sizeof req - 1 - n, 0);
        if (r <= 0) return;
        n += (size_t)r;
        req[n] = '\0';
        char *end = strstr(req, "\r\n\r\n");
        if (!end) continue;
        const char *cl = strcasestr(req, "content-length:");
        size_t want = cl ? strtoul(cl + 15, NULL, 10) : 0;
        if ((size_t)(req + n - (end + 4)) >= want || n >= sizeof req - 1) break;
    }
    pthread_mutex_lock(&f->mu);
    f->requests++;
    int hang = f->hang, status = f->status;
    size_t huge = f->huge_len, len = f->body_len;
    char *body = malloc(len + 1);
    if (body) memcpy(body, f->body ? f->body : "", len);
    pthread_mutex_unlock(&f->mu);
    if (!body) return;
    if (hang) {
        while (!f->stop && f->hang) usleep(20000);
        free(body);
        return;
    }
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                      status, huge ? huge : len);
    if (write_all(fd, head, (size_t)hl) == 0) {
        if (huge) {
            char chunk[65536];
            memset(chunk, '[', sizeof chunk);
            for (size_t sent = 0; sent < huge && !f->stop;) {
                size_t k = huge - sent < sizeof chunk ? huge - sent : sizeof chunk;
                if (write_all(fd, chunk, k)) break;
                sent += k;
            }
        } else {
            write_all(fd, body, len);
        }
    }
    free(body);
}

static void *fake_main(void *arg)
{
    fake_http_t *f = arg;
    while (!f->stop) {
        struct pollfd p = {f->listen_fd, POLLIN, 0};
        if (poll(&p, 1, 50) <= 0) continue;
        int fd = accept(f->listen_fd, NULL, NULL);
        if (fd < 0) continue;
        serve(f, fd);
        close(fd);
    }
    return NULL;
}

int fake_http_start(fake_http_t *f)
{
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    f->status = 200;
    f->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    if (f->listen_fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (bind(f->listen_fd, (struct sockaddr *)&a, sizeof a) || listen(f->listen_fd, 16) ||
        getsockname(f->listen_fd, (struct sockaddr *)&a, &len)) {
        close(f->listen_fd);
        return -1;
    }
    f->port = ntohs(a.sin_port);
    if (pthread_create(&f->thread, NULL, fake_main, f)) {
        close(f->listen_fd);
        return -1;
    }
    return 0;
}

void fake_http_set(fake_http_t *f, int status, const char *body)
{
    pthread_mutex_lock(&f->mu);
    free(f->body);
    f->body = strdup(body);
    f->body_len = strlen(body);
    f->status = status;
    f->huge_len = 0;
    f->hang = 0;
    pthread_mutex_unlock(&f->mu);
}

void fake_http_set_huge(fake_http_t *f, size_t len)
{
    pthread_mutex_lock(&f->mu);
    f->status = 200;
    f->huge_len = len;
    f->hang = 0;
    pthread_mutex_unlock(&f->mu);
}

void fake_http_set_hang(fake_http_t *f, int hang)
{
    pthread_mutex_lock(&f->mu);
    f->hang = hang;
    pthread_mutex_unlock(&f->mu);
}

void fake_http_stop(fake_http_t *f)
{
    f->stop = 1;
    pthread_join(f->thread, NULL);
    close(f->listen_fd);
    free(f->body);
    pthread_mutex_destroy(&f->mu);
}
