/* The peer bench's upstream: a minimal HTTP/1.1 server on 127.0.0.1.
 *
 *   upstream [MAX_SECONDS]
 *
 * Binds 127.0.0.1 on a port the kernel picks and prints it on stdout. Every
 * request gets "ok" (Content-Length 2), except GET /mb/N, which gets N MiB of
 * 'x' (the throughput test). Keep-alive is honoured: an HTTP/1.1 connection
 * stays open unless the request says "Connection: close", an HTTP/1.0 one
 * only if it says "keep-alive". One thread per connection. It exits when its
 * stdin reaches end of file (the bench closes it) or after MAX_SECONDS
 * (default 3600), whichever comes first, so it never outlives the bench.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define HEAD_MAX 16384
#define MIB (1 << 20)
#define IDLE_SECONDS 30

static char block[MIB];

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The value of header NAME in HEAD (lines after the first), or NULL. */
static const char *header(const char *head, const char *name, size_t *len) {
    size_t nl = strlen(name);
    const char *line = strstr(head, "\r\n");
    while (line && line[2] != '\r') {
        line += 2;
        const char *end = strstr(line, "\r\n");
        if (!end) return NULL;
        if ((size_t)(end - line) > nl && line[nl] == ':' && strncasecmp(line, name, nl) == 0) {
            const char *v = line + nl + 1;
            while (v < end && (*v == ' ' || *v == '\t')) v++;
            *len = (size_t)(end - v);
            return v;
        }
        line = end;
    }
    return NULL;
}

static int has_token(const char *v, size_t len, const char *token) {
    size_t tl = strlen(token);
    for (size_t i = 0; i + tl <= len; i++)
        if (strncasecmp(v + i, token, tl) == 0) return 1;
    return 0;
}

static void *serve(void *arg) {
    int fd = (int)(long)arg;
    char buf[HEAD_MAX + 1];
    size_t have = 0;
    struct timeval idle = {IDLE_SECONDS, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &idle, sizeof idle);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &idle, sizeof idle);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (;;) {
        char *end;
        buf[have] = 0;
        while (!(end = strstr(buf, "\r\n\r\n"))) {
            if (have >= HEAD_MAX) goto done;
            ssize_t r = recv(fd, buf + have, HEAD_MAX - have, 0);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) goto done;
            have += (size_t)r;
            buf[have] = 0;
        }
        end += 4;
        char saved = *end;
        *end = 0;
        int http10 = strstr(buf, " HTTP/1.0\r\n") != NULL;
        size_t len = 0;
        const char *conn = header(buf, "Connection", &len);
        int keep = http10 ? (conn && has_token(conn, len, "keep-alive"))
                          : !(conn && has_token(conn, len, "close"));
        long long body = 0;
        const char *cl = header(buf, "Content-Length", &len);
        if (cl) body = atoll(cl);
        long long mb = 0;
        if (strncmp(buf, "GET ", 4) == 0) {
            const char *path = buf + 4;
            const char *mbp = strstr(path, "/mb/");
            const char *sp = strchr(path, ' ');
            if (mbp && sp && mbp < sp) mb = atoll(mbp + 4);
        }
        *end = saved;
        /* Drop the request body, if any (the bench sends none). */
        size_t used = (size_t)(end - buf);
        size_t rest = have - used;
        memmove(buf, end, rest);
        have = rest;
        while (body > 0) {
            if (have) {
                size_t take = (long long)have < body ? have : (size_t)body;
                memmove(buf, buf + take, have - take);
                have -= take;
                body -= (long long)take;
                continue;
            }
            ssize_t r = recv(fd, buf, HEAD_MAX, 0);
            if (r <= 0) goto done;
            have = (size_t)r;
        }
        char head[256];
        long long length = mb > 0 ? mb * MIB : 2;
        int n = snprintf(head, sizeof head,
                         "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         "Content-Length: %lld\r\n%s\r\n",
                         length, keep ? (http10 ? "Connection: keep-alive\r\n" : "")
                                      : "Connection: close\r\n");
        if (mb > 0) {
            if (send_all(fd, head, (size_t)n)) goto done;
            for (long long i = 0; i < mb; i++)
                if (send_all(fd, block, MIB)) goto done;
        } else {
            char whole[300];
            memcpy(whole, head, (size_t)n);
            memcpy(whole + n, "ok", 2);
            if (send_all(fd, whole, (size_t)n + 2)) goto done;
        }
        if (!keep) break;
    }
done:
    close(fd);
    return NULL;
}

static void *watch_stdin(void *arg) {
    (void)arg;
    char c[256];
    while (read(0, c, sizeof c) > 0) {
    }
    _exit(0);
}

int main(int argc, char **argv) {
    unsigned max_seconds = argc > 1 ? (unsigned)atoi(argv[1]) : 3600;
    memset(block, 'x', sizeof block);
    signal(SIGPIPE, SIG_IGN);
    alarm(max_seconds); /* SIGALRM's default action ends the process */
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&addr, sizeof addr) || listen(ls, 4096)) {
        perror("upstream: bind");
        return 1;
    }
    socklen_t sl = sizeof addr;
    getsockname(ls, (struct sockaddr *)&addr, &sl);
    printf("%d\n", ntohs(addr.sin_port));
    fflush(stdout);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t t;
    pthread_create(&t, &attr, watch_stdin, NULL);
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE) continue;
            perror("upstream: accept");
            return 1;
        }
        if (pthread_create(&t, &attr, serve, (void *)(long)fd)) close(fd);
    }
}
