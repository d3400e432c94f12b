/* The peer bench's client: one connection per request, through an HTTP proxy
 * or straight to the upstream.
 *
 *   client lat    HOST PORT MODE TARGET N        N requests one after another
 *   client rps    HOST PORT MODE TARGET CLIENTS MS   CLIENTS threads for MS ms
 *   client tunnel HOST PORT MODE TARGET MB       one download of MB MiB
 *   client mix    HOST TARGET N PAUSE_US PORT:MODE...  N requests to each, alternating
 *   client keep   HOST TARGET N PORT:MODE...  N requests to each on a kept-alive connection
 *
 * HOST:PORT is where it connects (the proxy, or the upstream for MODE
 * "direct"); TARGET is the upstream's host:port. MODE "proxy" sends an
 * absolute-form GET (lat, rps) or a CONNECT followed by an origin-form GET
 * inside the tunnel (tunnel); "direct" sends the origin-form GET itself. The
 * request does not ask to close: the client reads one whole response (by
 * Content-Length, chunked, or to end of file) and closes. Every socket
 * operation gives up after 30 s; a request that fails is counted, not retried.
 * "mix" takes turns between the endpoints request by request (one request to
 * each, then the next round), so that a burst of load on a shared machine falls
 * on all of them alike; it waits PAUSE_US after each request, untimed, so that
 * work an endpoint does after its answer (a log line, a record) is not charged
 * to the next one. Prints one JSON line: latencies in microseconds (lat;
 * mix: a list per endpoint, errors too), requests done and the elapsed seconds
 * (rps), bytes and seconds (tunnel), errors in each. "keep" sends its requests
 * on one connection per endpoint, opening a new one only where the last answer
 * said "Connection: close" or the connection ended, taking turns as "mix" does;
 * it prints the latencies and the connections each endpoint took.
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
#include <time.h>
#include <unistd.h>

#define HEAD_MAX 16384
#define IO_SECONDS 30

struct endpoint {
    struct sockaddr_in where;
    char request[1024];
    size_t request_len;
};

static struct endpoint main_endpoint;
static int direct;
static char target[256];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

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

static int dial(const struct sockaddr_in *where) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval io = {IO_SECONDS, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &io, sizeof io);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &io, sizeof io);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (const struct sockaddr *)where, sizeof *where)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Read a response head into buf (NUL-terminated); returns its length, with
 * *have the bytes read in all (the head and what followed it), or -1. */
static long read_head(int fd, char *buf, size_t *have) {
    *have = 0;
    for (;;) {
        buf[*have] = 0;
        char *end = strstr(buf, "\r\n\r\n");
        if (end) return (long)(end + 4 - buf);
        if (*have >= HEAD_MAX) return -1;
        ssize_t r = recv(fd, buf + *have, HEAD_MAX - *have, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        *have += (size_t)r;
    }
}

static const char *header(const char *head, size_t head_len, const char *name) {
    size_t nl = strlen(name);
    const char *p = strstr(head, "\r\n");
    while (p && (size_t)(p - head) + 2 < head_len) {
        p += 2;
        if ((size_t)(p - head) + nl < head_len && p[nl] == ':' && strncasecmp(p, name, nl) == 0) {
            p += nl + 1;
            while (*p == ' ' || *p == '\t') p++;
            return p;
        }
        p = strstr(p, "\r\n");
    }
    return NULL;
}

/* Reads exactly n body bytes, the first `have` of them already in buf. */
static long long read_exact(int fd, char *scratch, size_t cap, long long n, size_t have) {
    long long got = (long long)have < n ? (long long)have : n;
    while (got < n) {
        size_t want = (size_t)((n - got) < (long long)cap ? (n - got) : (long long)cap);
        ssize_t r = recv(fd, scratch, want, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        got += r;
    }
    return got;
}

/* A chunked body: buf holds `have` bytes of it. Returns its payload length or -1. */
static long long read_chunked(int fd, char *buf, size_t have) {
    long long total = 0;
    for (;;) {
        char *eol;
        buf[have] = 0;
        while (!(eol = strstr(buf, "\r\n"))) {
            if (have >= HEAD_MAX) return -1;
            ssize_t r = recv(fd, buf + have, HEAD_MAX - have, 0);
            if (r <= 0) return -1;
            have += (size_t)r;
            buf[have] = 0;
        }
        long long size = strtoll(buf, NULL, 16);
        size_t line = (size_t)(eol + 2 - buf);
        if (size == 0) {
            /* Trailers, if any, then the blank line. */
            memmove(buf, buf + line, have - line);
            have -= line;
            for (;;) {
                buf[have] = 0;
                if (have >= 2 && strncmp(buf, "\r\n", 2) == 0) return total;
                char *end = strstr(buf, "\r\n\r\n");
                if (end) return total;
                if (have >= HEAD_MAX) return -1;
                ssize_t r = recv(fd, buf + have, HEAD_MAX - have, 0);
                if (r <= 0) return -1;
                have += (size_t)r;
            }
        }
        long long need = size + 2; /* the data and its CRLF */
        long long in = (long long)(have - line);
        if (in >= need) {
            memmove(buf, buf + line + need, (size_t)(in - need));
            have = (size_t)(in - need);
        } else {
            if (read_exact(fd, buf, HEAD_MAX, need, (size_t)in) < 0) return -1;
            have = 0;
        }
        total += size;
    }
}

static long long read_response_closing(int fd, int *closes);

/* One response on fd: 200 and a whole body, or -1. Returns the body's length. */
static long long read_response(int fd) {
    int closes;
    return read_response_closing(fd, &closes);
}

/* As read_response; *closes says whether the connection ends after it (the
 * response said so, is HTTP/1.0, or was read to its end). */
static long long read_response_closing(int fd, int *closes) {
    char buf[HEAD_MAX + 1];
    size_t have;
    *closes = 1;
    long head = read_head(fd, buf, &have);
    if (head < 0 || strncmp(buf, "HTTP/1.", 7) != 0 || strncmp(buf + 8, " 200", 4) != 0)
        return -1;
    const char *conn = header(buf, (size_t)head, "Connection");
    *closes = strncmp(buf, "HTTP/1.0", 8) == 0 || (conn && strncasecmp(conn, "close", 5) == 0);
    size_t extra = have - (size_t)head;
    const char *te = header(buf, (size_t)head, "Transfer-Encoding");
    const char *cl = header(buf, (size_t)head, "Content-Length");
    if (te && strncasecmp(te, "chunked", 7) == 0) {
        memmove(buf, buf + head, extra);
        return read_chunked(fd, buf, extra);
    }
    static __thread char big[1 << 20];
    if (cl) return read_exact(fd, big, sizeof big, atoll(cl), extra);
    *closes = 1;
    long long got = (long long)extra;
    for (;;) {
        ssize_t r = recv(fd, big, sizeof big, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) return got;
        got += r;
    }
}

/* One request on a connection of its own; its body length, or -1. */
static long long one_request(const struct endpoint *e) {
    int fd = dial(&e->where);
    if (fd < 0) return -1;
    long long n = -1;
    if (send_all(fd, e->request, e->request_len) == 0) n = read_response(fd);
    close(fd);
    return n;
}

struct load {
    double until;
    long done, errors;
};

static void *load_thread(void *arg) {
    struct load *l = arg;
    while (now() < l->until) {
        if (one_request(&main_endpoint) == 2)
            l->done++;
        else
            l->errors++;
    }
    return NULL;
}

static int usage(void) {
    fprintf(stderr,
            "usage: client lat|rps|tunnel HOST PORT direct|proxy TARGET N|CLIENTS MS|MB\n"
            "       client mix HOST TARGET N PAUSE_US PORT:direct|proxy...\n"
            "       client keep HOST TARGET N PORT:direct|proxy...\n");
    return 2;
}

/* The GET that MODE sends to TARGET: origin-form to the upstream itself,
 * absolute-form to a proxy. */
static int prepare(struct endpoint *e, const char *host, int port, const char *mode,
                   const char *to) {
    memset(e, 0, sizeof *e);
    e->where.sin_family = AF_INET;
    e->where.sin_port = htons((unsigned short)port);
    if (port <= 0 || port > 65535 || inet_pton(AF_INET, host, &e->where.sin_addr) != 1) return -1;
    if (strcmp(mode, "direct") == 0)
        e->request_len = (size_t)snprintf(e->request, sizeof e->request,
                                          "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", to);
    else if (strcmp(mode, "proxy") == 0)
        e->request_len = (size_t)snprintf(e->request, sizeof e->request,
                                          "GET http://%s/ HTTP/1.1\r\nHost: %s\r\n\r\n", to,
                                          to);
    else
        return -1;
    return 0;
}

#define MIX_MAX 16

/* The PORT:MODE endpoints of mix and keep, each with room for n samples; 0, or
 * the exit code (usage, or 1 out of memory). */
static int endpoints(struct endpoint *ends, double **samples, int count, char **specs,
                     const char *host, const char *to, long n) {
    for (int i = 0; i < count; i++) {
        char mode[16] = "";
        int port = 0;
        if (sscanf(specs[i], "%d:%15s", &port, mode) != 2 ||
            prepare(&ends[i], host, port, mode, to))
            return usage();
        samples[i] = calloc((size_t)n, sizeof(double));
        if (!samples[i]) return 1;
    }
    return 0;
}

static int mix(int argc, char **argv) {
    /* client mix HOST TARGET N PAUSE_US PORT:MODE... */
    int count = argc - 6;
    long n = atol(argv[4]);
    long pause_us = atol(argv[5]);
    if (count < 1 || count > MIX_MAX || n < 1 || pause_us < 0 || pause_us > 1000000)
        return usage();
    struct timespec pause = {pause_us / 1000000, (pause_us % 1000000) * 1000};
    static struct endpoint ends[MIX_MAX];
    static double *samples[MIX_MAX];
    long kept[MIX_MAX] = {0}, errors[MIX_MAX] = {0};
    int bad = endpoints(ends, samples, count, argv + 6, argv[2], argv[3], n);
    if (bad) return bad;
    for (long r = 0; r < n; r++) {
        for (int i = 0; i < count; i++) {
            double t = now();
            long long got = one_request(&ends[i]);
            double us = (now() - t) * 1e6;
            if (got == 2)
                samples[i][kept[i]++] = us;
            else
                errors[i]++;
            if (pause_us) nanosleep(&pause, NULL);
        }
    }
    printf("{\"lat_us\": [");
    for (int i = 0; i < count; i++) {
        printf("%s[", i ? ", " : "");
        for (long j = 0; j < kept[i]; j++) printf("%s%.1f", j ? ", " : "", samples[i][j]);
        printf("]");
    }
    printf("], \"errors\": [");
    for (int i = 0; i < count; i++) printf("%s%ld", i ? ", " : "", errors[i]);
    printf("]}\n");
    return 0;
}

static int keep(int argc, char **argv) {
    /* client keep HOST TARGET N PORT:MODE... */
    int count = argc - 5;
    long n = atol(argv[4]);
    if (count < 1 || count > MIX_MAX || n < 1) return usage();
    static struct endpoint ends[MIX_MAX];
    static double *samples[MIX_MAX];
    long kept[MIX_MAX] = {0}, errors[MIX_MAX] = {0}, dialed[MIX_MAX] = {0};
    int fds[MIX_MAX];
    int bad = endpoints(ends, samples, count, argv + 5, argv[2], argv[3], n);
    if (bad) return bad;
    for (int i = 0; i < count; i++) fds[i] = -1;
    for (long r = 0; r < n; r++) {
        for (int i = 0; i < count; i++) {
            double t = now();
            long long got = -1;
            int closes = 1;
            /* A kept connection the other end closed unannounced is retried once on a
             * new one, as HTTP clients do (the time of both counted). */
            for (int attempt = 0; attempt < 2 && got != 2; attempt++) {
                int fresh = fds[i] < 0;
                if (fresh) {
                    fds[i] = dial(&ends[i].where);
                    dialed[i]++;
                }
                if (fds[i] >= 0 && send_all(fds[i], ends[i].request, ends[i].request_len) == 0)
                    got = read_response_closing(fds[i], &closes);
                if (got != 2 && fds[i] >= 0) {
                    close(fds[i]);
                    fds[i] = -1;
                }
                if (fresh) break;
            }
            double us = (now() - t) * 1e6;
            if (got == 2)
                samples[i][kept[i]++] = us;
            else
                errors[i]++;
            if ((got != 2 || closes) && fds[i] >= 0) {
                close(fds[i]);
                fds[i] = -1;
            }
        }
    }
    printf("{\"lat_us\": [");
    for (int i = 0; i < count; i++) {
        printf("%s[", i ? ", " : "");
        for (long j = 0; j < kept[i]; j++) printf("%s%.1f", j ? ", " : "", samples[i][j]);
        printf("]");
    }
    printf("], \"errors\": [");
    for (int i = 0; i < count; i++) printf("%s%ld", i ? ", " : "", errors[i]);
    printf("], \"connections\": [");
    for (int i = 0; i < count; i++) printf("%s%ld", i ? ", " : "", dialed[i]);
    printf("]}\n");
    for (int i = 0; i < count; i++)
        if (fds[i] >= 0) close(fds[i]);
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 6 && strcmp(argv[1], "keep") == 0) return keep(argc, argv);
    if (argc >= 7 && strcmp(argv[1], "mix") == 0) return mix(argc, argv);
    if (argc < 7) return usage();
    const char *what = argv[1];
    if (prepare(&main_endpoint, argv[2], atoi(argv[3]), argv[4], argv[5])) return usage();
    direct = strcmp(argv[4], "direct") == 0;
    snprintf(target, sizeof target, "%s", argv[5]);
    if (strcmp(what, "tunnel") == 0) {
        long long mb = atoll(argv[6]);
        char get[512];
        int gl = snprintf(get, sizeof get, "GET /mb/%lld HTTP/1.1\r\nHost: %s\r\n\r\n", mb,
                          target);
        double t = now();
        int fd = dial(&main_endpoint.where);
        long long n = -1;
        if (fd >= 0) {
            int ok = 1;
            if (!direct) {
                char connect_head[512];
                int cl = snprintf(connect_head, sizeof connect_head,
                                  "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target);
                char buf[HEAD_MAX + 1];
                size_t have;
                ok = send_all(fd, connect_head, (size_t)cl) == 0 &&
                     read_head(fd, buf, &have) > 0 && strncmp(buf + 8, " 200", 4) == 0;
            }
            if (ok && send_all(fd, get, (size_t)gl) == 0) n = read_response(fd);
            close(fd);
        }
        double s = now() - t;
        int bad = n != mb << 20;
        printf("{\"bytes\": %lld, \"seconds\": %.6f, \"errors\": %d}\n", bad ? 0 : n, s, bad);
        return 0;
    }
    if (strcmp(what, "lat") == 0) {
        long n = atol(argv[6]), errors = 0;
        printf("{\"lat_us\": [");
        int first = 1;
        for (long i = 0; i < n; i++) {
            double t = now();
            long long got = one_request(&main_endpoint);
            double us = (now() - t) * 1e6;
            if (got != 2) {
                errors++;
                continue;
            }
            printf("%s%.1f", first ? "" : ", ", us);
            first = 0;
        }
        printf("], \"errors\": %ld}\n", errors);
        return 0;
    }
    if (strcmp(what, "rps") == 0 && argc >= 8) {
        int clients = atoi(argv[6]);
        long ms = atol(argv[7]);
        if (clients < 1 || clients > 256) return usage();
        struct load loads[256];
        pthread_t threads[256];
        double t = now();
        for (int i = 0; i < clients; i++) {
            loads[i] = (struct load){.until = t + (double)ms / 1000.0};
            pthread_create(&threads[i], NULL, load_thread, &loads[i]);
        }
        long done = 0, errors = 0;
        for (int i = 0; i < clients; i++) {
            pthread_join(threads[i], NULL);
            done += loads[i].done;
            errors += loads[i].errors;
        }
        printf("{\"done\": %ld, \"errors\": %ld, \"seconds\": %.6f}\n", done, errors, now() - t);
        return 0;
    }
    return usage();
}
