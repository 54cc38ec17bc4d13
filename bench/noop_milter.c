/* A no-op milter for benchmarks, in C on Sendmail's libmilter: the same filter as bench/noop_milter.py
 * (continue at every stage, accept at end of message, no modification), but not the bottleneck: libmilter
 * runs one thread per filter connection, where the Python one serves every connection on one event loop.
 *
 * Both MTAs under test (Postfix's smtpd_milters, mtaq's) talk to the same filter, so that
 * compare_postfix.py --milter measures the cost of a filter in the path on both sides alike.
 *   --mode full (default): every stage is asked for (connect, HELO, MAIL, RCPT, DATA, each header, end of
 *                          headers, the body) and answered, as a scanner that reads the whole message does;
 *   --mode eom:            every stage but the end of message is negotiated away (SMFIP_NOCONNECT ..
 *                          SMFIP_NODATA, as far as the MTA offers them), the cheapest filter there is.
 *
 * Protocol: libmilter (mfapi.h, smfi_register(3)), version 6 with xxfi_negotiate.
 *
 *   cc -O2 -o build/noop_milter bench/noop_milter.c -lmilter -lpthread     (Debian: gcc libmilter-dev)
 *   build/noop_milter --port 8891 [--host 127.0.0.1] [--mode full|eom]
 *
 * Prints one line "noop_milter: listening on HOST:PORT" when the socket listens; on SIGTERM (or SIGINT),
 * one line "noop_milter: connections=N messages=M" (M: end-of-message commands answered), and exits 0
 * (within 5 s: libmilter's listener looks for the stop every 5 s).
 * compare_postfix.py builds it into build/ on first use (bench/compare_postfix.py: noop_milter_binary).
 */
#include <libmilter/mfapi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* The stages mode eom leaves out (mfdef.h SMFIP_NOCONNECT .. SMFIP_NODATA), as noop_milter.py's
 * SKIP_ALL_BUT_EOM. */
#define SKIP_ALL_BUT_EOM (SMFIP_NOCONNECT | SMFIP_NOHELO | SMFIP_NOMAIL | SMFIP_NORCPT | SMFIP_NOBODY | \
                          SMFIP_NOHDRS | SMFIP_NOEOH | SMFIP_NOUNKNOWN | SMFIP_NODATA)

static int eom_only = 0;
static unsigned long connections = 0; /* updated with atomic builtins: one thread per connection */
static unsigned long messages = 0;

static sfsistat on_negotiate(SMFICTX *ctx, unsigned long f0, unsigned long f1, unsigned long f2,
                             unsigned long f3, unsigned long *pf0, unsigned long *pf1, unsigned long *pf2,
                             unsigned long *pf3) {
    (void)ctx; (void)f0; (void)f2; (void)f3;
    __atomic_fetch_add(&connections, 1, __ATOMIC_RELAXED);
    *pf0 = 0;                                         /* actions: none (it changes nothing) */
    *pf1 = eom_only ? (f1 & SKIP_ALL_BUT_EOM) : 0;    /* protocol steps left out */
    *pf2 = 0;
    *pf3 = 0;
    return SMFIS_CONTINUE;
}

static sfsistat on_connect(SMFICTX *ctx, char *host, _SOCK_ADDR *addr) {
    (void)ctx; (void)host; (void)addr;
    return SMFIS_CONTINUE;
}

static sfsistat on_helo(SMFICTX *ctx, char *name) {
    (void)ctx; (void)name;
    return SMFIS_CONTINUE;
}

static sfsistat on_envfrom(SMFICTX *ctx, char **argv) {
    (void)ctx; (void)argv;
    return SMFIS_CONTINUE;
}

static sfsistat on_envrcpt(SMFICTX *ctx, char **argv) {
    (void)ctx; (void)argv;
    return SMFIS_CONTINUE;
}

static sfsistat on_data(SMFICTX *ctx) {
    (void)ctx;
    return SMFIS_CONTINUE;
}

static sfsistat on_header(SMFICTX *ctx, char *name, char *value) {
    (void)ctx; (void)name; (void)value;
    return SMFIS_CONTINUE;
}

static sfsistat on_eoh(SMFICTX *ctx) {
    (void)ctx;
    return SMFIS_CONTINUE;
}

static sfsistat on_body(SMFICTX *ctx, unsigned char *chunk, size_t len) {
    (void)ctx; (void)chunk; (void)len;
    return SMFIS_CONTINUE;
}

static sfsistat on_eom(SMFICTX *ctx) {
    (void)ctx;
    __atomic_fetch_add(&messages, 1, __ATOMIC_RELAXED);
    return SMFIS_ACCEPT;
}

static sfsistat on_abort(SMFICTX *ctx) {
    (void)ctx;
    return SMFIS_CONTINUE;
}

static sfsistat on_close(SMFICTX *ctx) {
    (void)ctx;
    return SMFIS_CONTINUE;
}

static struct smfiDesc desc = {
    "noop_milter", SMFI_VERSION, 0,
    on_connect, on_helo, on_envfrom, on_envrcpt, on_header, on_eoh, on_body, on_eom, on_abort, on_close,
    NULL /* unknown */, on_data, on_negotiate,
};

static void usage(const char *argv0) {
    fprintf(stderr, "usage: %s --port PORT [--host HOST] [--mode full|eom]\n", argv0);
    exit(2);
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    const char *port = NULL;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--port") == 0) {
            port = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--host") == 0) {
            host = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--mode") == 0) {
            const char *mode = argv[++i];
            if (strcmp(mode, "eom") == 0) {
                eom_only = 1;
            } else if (strcmp(mode, "full") != 0) {
                usage(argv[0]);
            }
        } else {
            usage(argv[0]);
        }
    }
    if (port == NULL || atoi(port) <= 0) {
        usage(argv[0]);
    }
    char conn[300];
    snprintf(conn, sizeof conn, "inet:%s@%s", port, host);
    if (smfi_setconn(conn) != MI_SUCCESS || smfi_setbacklog(1024) != MI_SUCCESS ||
        smfi_register(desc) != MI_SUCCESS) {
        fprintf(stderr, "noop_milter: cannot set up %s\n", conn);
        return 1;
    }
    if (smfi_opensocket(0) != MI_SUCCESS) {
        fprintf(stderr, "noop_milter: cannot listen on %s:%s\n", host, port);
        return 1;
    }
    printf("noop_milter: listening on %s:%s\n", host, port);
    fflush(stdout);
    int rc = smfi_main(); /* returns after SIGTERM, SIGINT or SIGHUP (libmilter's signal thread: smfi_stop) */
    printf("noop_milter: connections=%lu messages=%lu\n", __atomic_load_n(&connections, __ATOMIC_RELAXED),
           __atomic_load_n(&messages, __ATOMIC_RELAXED));
    fflush(stdout);
    return rc == MI_SUCCESS ? 0 : 1;
}
