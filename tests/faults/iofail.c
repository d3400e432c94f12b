/*
 * iofail: an LD_PRELOAD shim that makes one chosen I/O call fail with EIO.
 *
 * It stands in for a failing disk under the ledger's store, so that the tests
 * can watch what Proctor does when a write or an fsync of its database really
 * fails (SQLite sees the same errno a bad disk gives it).
 *
 * Environment, read once when the library loads:
 *   IOFAIL_OP     "fsync" (fsync, fdatasync) or "write" (write, pwrite,
 *                 pwrite64, writev, pwritev); anything else: the shim is inert.
 *   IOFAIL_MATCH  a substring of the file's path (readlink /proc/self/fd/N);
 *                 only calls on such files are counted. Empty: every file.
 *   IOFAIL_NTH    fail the Nth matching call (1-based) counted from load;
 *                 unset or 0: disarmed until iofail_arm() is called.
 *   IOFAIL_COUNT  how many consecutive matching calls fail from the Nth on
 *                 (default 1).
 *
 * Exported for a process that wants to pick the moment (ctypes):
 *   void iofail_arm(int nth)  restart counting now; fail the nth matching call
 *   int  iofail_hits(void)    how many calls have been made to fail so far
 *   int  iofail_seen(void)    how many matching calls were counted since arming
 *
 * Build: gcc -shared -fPIC -O2 -o libiofail.so iofail.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { OP_NONE, OP_FSYNC, OP_WRITE };

static int op = OP_NONE;
static char match[512];
static volatile int nth;   /* 0: disarmed */
static int count = 1;
static int seen;           /* matching calls since arming (atomic) */
static int hits;           /* failures injected (atomic) */

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);

__attribute__((constructor)) static void iofail_init(void) {
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    real_write = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    real_pwrite = (ssize_t(*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
    real_pwrite64 = (ssize_t(*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite64");
    real_writev = (ssize_t(*)(int, const struct iovec *, int))dlsym(RTLD_NEXT, "writev");
    real_pwritev = (ssize_t(*)(int, const struct iovec *, int, off_t))dlsym(RTLD_NEXT, "pwritev");

    const char *o = getenv("IOFAIL_OP");
    if (o && strcmp(o, "fsync") == 0)
        op = OP_FSYNC;
    else if (o && strcmp(o, "write") == 0)
        op = OP_WRITE;
    const char *m = getenv("IOFAIL_MATCH");
    if (m) {
        strncpy(match, m, sizeof match - 1);
        match[sizeof match - 1] = '\0';
    }
    const char *n = getenv("IOFAIL_NTH");
    nth = n ? atoi(n) : 0;
    const char *c = getenv("IOFAIL_COUNT");
    if (c && atoi(c) > 0)
        count = atoi(c);
}

void iofail_arm(int n) {
    __atomic_store_n(&seen, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&nth, n, __ATOMIC_SEQ_CST);
}

int iofail_hits(void) { return __atomic_load_n(&hits, __ATOMIC_SEQ_CST); }

int iofail_seen(void) { return __atomic_load_n(&seen, __ATOMIC_SEQ_CST); }

/* Should this call on fd fail? Counts it if it is a matching call. */
static int should_fail(int kind, int fd) {
    int armed = __atomic_load_n(&nth, __ATOMIC_SEQ_CST);
    if (kind != op || armed <= 0)
        return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(link, path, sizeof path - 1);
    if (len < 0)
        return 0;
    path[len] = '\0';
    if (match[0] && strstr(path, match) == NULL)
        return 0;
    int k = __atomic_add_fetch(&seen, 1, __ATOMIC_SEQ_CST);
    if (k < armed || k >= armed + count)
        return 0;
    __atomic_add_fetch(&hits, 1, __ATOMIC_SEQ_CST);
    return 1;
}

int fsync(int fd) {
    if (should_fail(OP_FSYNC, fd)) {
        errno = EIO;
        return -1;
    }
    return real_fsync(fd);
}

int fdatasync(int fd) {
    if (should_fail(OP_FSYNC, fd)) {
        errno = EIO;
        return -1;
    }
    return real_fdatasync(fd);
}

ssize_t write(int fd, const void *buf, size_t n) {
    if (should_fail(OP_WRITE, fd)) {
        errno = EIO;
        return -1;
    }
    return real_write(fd, buf, n);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    if (should_fail(OP_WRITE, fd)) {
        errno = EIO;
        return -1;
    }
    return real_pwrite(fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    if (should_fail(OP_WRITE, fd)) {
        errno = EIO;
        return -1;
    }
    return real_pwrite64(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    if (should_fail(OP_WRITE, fd)) {
        errno = EIO;
        return -1;
    }
    return real_writev(fd, iov, cnt);
}

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    if (should_fail(OP_WRITE, fd)) {
        errno = EIO;
        return -1;
    }
    return real_pwritev(fd, iov, cnt, off);
}
