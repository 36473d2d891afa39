/* exec-as: become an unprivileged user with resource limits, then exec a program.
 *
 * What util-linux's `prlimit --RES=SOFT:HARD ... -- setpriv --reuid --regid --groups -- PROGRAM`
 * does for a bwrap sandbox (runtime/oci/bwrap.py), in one exec instead of two (~1.4 ms less CPU
 * per sandbox, measured). Compiled on first use by bwrap.py; without a C compiler the two
 * util-linux programs are used instead.
 *
 *   exec-as UID GID GROUPS [RESOURCE=SOFT:HARD | /CGROUP-DIR | NETNS | net.KEY=VALUE ...] -- PROGRAM [ARG ...]
 *
 * GROUPS is a comma-separated list of gids (the supplementary groups); RESOURCE is a Linux
 * RLIMIT_* number, SOFT and HARD decimal or "inf"; a /CGROUP-DIR (a cgroup v1 directory) is
 * joined by this process itself, writing "0" to its `tasks`: a single thread moving itself takes
 * no cgroup_threadgroup_rwsem, so it does not wait for the RCU grace period that moving another
 * process by pid through `cgroup.procs` waits for on this kernel (measured: 0.5 ms against 3-12
 * for four controllers). This process is single-threaded, so its one thread is all of it, and
 * everything it becomes and starts (bwrap, the sandbox) is born inside. Cgroups are joined and
 * limits set first (as root: limits may be raised), then the groups, the gid and the uid; the
 * change is checked (every uid and gid is the new one, and uid 0 cannot be had back) before
 * PROGRAM (an absolute path) is executed. Any failure exits 125 with the reason on stderr, before
 * anything runs.
 *
 * NETNS makes the sandbox's network namespace here, as root, before the user changes: a new one
 * with only `lo`, brought up (the kernel gives it 127.0.0.1 and ::1); each net.KEY=VALUE after it
 * is a sysctl written in it (Docker's: unprivileged ports from 0, ping for every group). bwrap then
 * runs without --unshare-net and the sandbox is born in it. As under runc, the namespace belongs
 * to the host's user namespace, not the sandbox's: nothing the sandbox holds can configure it. It
 * spares the launcher a thread that enters the namespace to write the sysctls once bwrap's child
 * waits (~2 ms of every cold start, measured).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_GROUPS 64

static void die(const char *what, const char *arg) {
    fprintf(stderr, "exec-as: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", errno ? strerror(errno) : "invalid");
    exit(125);
}

static void join_cgroup(const char *dir) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/tasks", dir) >= (int)sizeof path)
        die("cgroup path too long", dir);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        die("cannot open", path);
    if (write(fd, "0", 1) != 1)
        die("cannot join the cgroup", dir);
    close(fd);
}

static int netns_made = 0;

static void new_netns(void) {
    if (unshare(CLONE_NEWNET) != 0)
        die("cannot make a network namespace", NULL);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) != 0)
        die("cannot read the flags of", "lo");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) != 0)
        die("cannot bring up", "lo");
    close(s);
    netns_made = 1;
}

/* net.KEY=VALUE: /proc/sys/net/KEY (dots as slashes) in the namespace NETNS made. */
static void net_sysctl(char *spec) {
    char path[PATH_MAX], *eq = strchr(spec, '=');
    errno = 0;
    if (!netns_made)
        die("a sysctl before NETNS", spec);
    if (!eq || eq == spec || strchr(spec, '/') || strstr(spec, ".."))
        die("bad sysctl", spec);
    *eq = '\0';
    if (snprintf(path, sizeof path, "/proc/sys/%s", spec) >= (int)sizeof path)
        die("sysctl too long", spec);
    for (char *c = path + strlen("/proc/sys/"); *c; c++)
        if (*c == '.')
            *c = '/';
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    size_t len = strlen(eq + 1);
    if (fd < 0 || write(fd, eq + 1, len) != (ssize_t)len)
        die("cannot write the sysctl", spec);
    close(fd);
}

static unsigned long long number(const char *text, unsigned long long max, const char *what) {
    char *end;
    if (strcmp(text, "inf") == 0)
        return RLIM_INFINITY;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || end == text || *end || text[0] == '-' || value > max)
        die(what, text);
    return value;
}

int main(int argc, char **argv) {
    if (argc < 6)
        die("usage: exec-as UID GID GROUPS [RES=SOFT:HARD | /CGROUP-DIR ...] -- PROGRAM [ARG ...]", NULL);
    uid_t uid = (uid_t)number(argv[1], UINT_MAX - 1, "bad uid");
    gid_t gid = (gid_t)number(argv[2], UINT_MAX - 1, "bad gid");
    gid_t groups[MAX_GROUPS];
    size_t ngroups = 0;
    char *list = argv[3], *item;
    while ((item = strsep(&list, ",")) != NULL) {
        if (ngroups == MAX_GROUPS)
            die("too many groups", argv[3]);
        groups[ngroups++] = (gid_t)number(item, UINT_MAX - 1, "bad group");
    }
    int i = 4;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        char *spec = argv[i], *eq = strchr(spec, '='), *colon = eq ? strchr(eq, ':') : NULL;
        if (spec[0] == '/') {
            join_cgroup(spec);
            continue;
        }
        if (strcmp(spec, "NETNS") == 0) {
            new_netns();
            continue;
        }
        if (strncmp(spec, "net.", 4) == 0) {
            net_sysctl(spec);
            continue;
        }
        if (!eq || !colon)
            die("bad limit", spec);
        *eq = *colon = '\0';
        struct rlimit limit = {number(eq + 1, ULLONG_MAX, "bad soft limit"), number(colon + 1, ULLONG_MAX, "bad hard limit")};
        if (setrlimit((int)number(spec, RLIMIT_NLIMITS - 1, "bad resource"), &limit) != 0)
            die("setrlimit", spec);
    }
    if (i + 1 >= argc || argv[i + 1][0] != '/')
        die("no absolute PROGRAM after --", NULL);
    if (setgroups(ngroups, groups) != 0)
        die("setgroups", argv[3]);
    if (setresgid(gid, gid, gid) != 0)
        die("setresgid", argv[2]);
    if (setresuid(uid, uid, uid) != 0)
        die("setresuid", argv[1]);
    uid_t r, e, s;
    gid_t gr, ge, gs;
    if (getresuid(&r, &e, &s) || getresgid(&gr, &ge, &gs) || r != uid || e != uid || s != uid || gr != gid ||
        ge != gid || gs != gid || (uid != 0 && setuid(0) == 0)) {
        errno = 0;
        die("the user did not change", argv[1]);
    }
    execv(argv[i + 1], argv + i + 1);
    die("cannot execute", argv[i + 1]);
    return 125;
}
