/* sandloop-start: a bwrap-class sandbox's whole start in one process, from one description.
 *
 * What sandloop did with Python, exec_as and bubblewrap (three programs, a system call at a time
 * from Python for the host's part), done by one small program that runs as root and ends as the
 * sandbox's monitor (starter.py builds the description; bwrap.py's translation of Docker's config
 * gives its sandbox part, the same options bwrap reads, so both start the same sandbox):
 *
 *   sandloop-start [HOST OPS] --user UID GID GROUPS [SANDBOX OPS] -- PROGRAM [ARG ...]
 *
 * HOST OPS, in order, as root on the host:
 *   --cgroup DIR          make the cgroup v1 directory DIR (its parent too, once); the --set after
 *                         it write into it
 *   --set FILE VALUE      write VALUE to DIR/FILE and read it back (the kernel may round a limit
 *                         down, never up: a larger read-back is a failure)
 *   --join                join every cgroup made so far ("0" to its tasks: this one thread moves
 *                         itself, no RCU grace period; everything after is charged to the sandbox)
 *   --mount-tmpfs DIR FLAGS DATA   make DIR (0700) and mount a tmpfs on it (FLAGS: MS_* as decimal)
 *   --rlimit RESOURCE SOFT HARD    setrlimit (RESOURCE: the kernel's number; "inf")
 *   --netns               a new network namespace with only lo, up (owned by the host's user
 *                         namespace, as under runc: nothing inside can configure it)
 *   --sysctl KEY VALUE    a net.* sysctl written in it
 *   --user UID GID GROUPS become UID/GID with the supplementary GROUPS (comma-separated), checked
 *                         (uid 0 cannot be had back); the sandbox part runs as that user
 * SANDBOX OPS (bubblewrap 0.8's meaning, the subset bwrap.py's translation emits):
 *   --unshare-user|-pid|-net|-ipc|-uts|-cgroup, --uid U, --gid G, --hostname H, --die-with-parent,
 *   --as-pid-1, --new-session, --cap-drop ALL, --ro-bind SRC DST, --bind SRC DST, --proc DST,
 *   --dev DST, --mqueue DST, --tmpfs DST, --remount-ro DST, --clearenv, --setenv K V, --chdir DIR,
 *   --seccomp FD, --info-fd FD
 *
 * After the host part this process clones the sandbox's PID 1 into new namespaces, which sets the
 * sandbox up (the user namespace maps only UID and GID to themselves; the mounts on a scratch
 * root, then pivot_root; hostname, session, every capability dropped, no_new_privs, the seccomp
 * program read from FD) and executes PROGRAM. Once it has (or failed), this process writes
 * {"child-pid": N} to the info fd (nothing if it failed) and closes it, then waits for it and exits
 * with its status (128+signal if it was killed), as bwrap's monitor does. The sandbox dies with
 * this process (PR_SET_PDEATHSIG), and this process with its parent. Any failure exits 125 with
 * the reason on stderr; what the host part made is removed by the caller (it knows every path).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_GROUPS 64
#define MAX_CGROUPS 16
#define MAX_OPS 256
#define MAX_FILTER 65536 /* instructions: BPF_MAXINSNS is 4096; libseccomp's tree stays far below */

static const char *stage = "sandloop-start";
/* In the sandbox before PROGRAM: a failure writes one byte here (the monitor then reports none). */
static int report_fd = -1;

static void die(const char *fmt, ...) {
    int saved = errno;
    va_list ap;
    fprintf(stderr, "%s: ", stage);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (saved)
        fprintf(stderr, ": %s", strerror(saved));
    fputc('\n', stderr);
    if (report_fd >= 0 && write(report_fd, "!", 1) != 1)
        _exit(125);
    _exit(125);
}

static unsigned long long number(const char *text, unsigned long long max, const char *what) {
    char *end;
    if (strcmp(text, "inf") == 0)
        return RLIM_INFINITY;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || end == text || *end || text[0] == '-' || value > max) {
        errno = 0;
        die("bad %s: %s", what, text);
    }
    return value;
}

/* OUT = A/B (OUT holds PATH_MAX bytes); a path too long is a failure, never cut short. */
static void joined(char *out, const char *a, const char *b) {
    if (snprintf(out, PATH_MAX, "%s/%s", a, b) >= PATH_MAX) {
        errno = 0;
        die("path too long: %s/%s", a, b);
    }
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    size_t len = strlen(text);
    if (fd < 0 || write(fd, text, len) != (ssize_t)len)
        die("cannot write %s to %s", text, path);
    close(fd);
}

/* -- the host part -------------------------------------------------------------------------- */
static char cgroups[MAX_CGROUPS][PATH_MAX];  /* each shorter than PATH_MAX */
static size_t ncgroups = 0;

static void make_cgroup(const char *dir) {
    if (ncgroups == MAX_CGROUPS || strlen(dir) >= PATH_MAX || dir[0] != '/' || strstr(dir, "..")) {
        errno = 0;
        die("bad cgroup %s", dir);
    }
    char parent[PATH_MAX];
    strcpy(parent, dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = '\0';
        if (mkdir(parent, 0755) != 0 && errno != EEXIST)
            die("cannot make the cgroup %s", parent);
    }
    if (mkdir(dir, 0755) != 0)
        die("cannot make the cgroup %s", dir);
    strcpy(cgroups[ncgroups++], dir);
}

static void set_cgroup(const char *file, const char *value) {
    char path[PATH_MAX], back[64];
    if (!ncgroups || strchr(file, '/')) {
        errno = 0;
        die("bad cgroup file %s", file);
    }
    joined(path, cgroups[ncgroups - 1], file);
    unsigned long long wanted = number(value, ULLONG_MAX, "cgroup value");
    write_file(path, value);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, back, sizeof back - 1);
    if (n <= 0)
        die("cannot read back %s", path);
    close(fd);
    back[n] = '\0';
    back[strcspn(back, "\n")] = '\0';
    errno = 0;
    if (number(back, ULLONG_MAX, "read-back value") > wanted)
        die("%s did not take (%s read back, %s wanted)", path, back, value);
}

static void join_cgroups(void) {
    char path[PATH_MAX];
    for (size_t i = 0; i < ncgroups; i++) {
        joined(path, cgroups[i], "tasks");
        write_file(path, "0");
    }
}

static void mount_host_tmpfs(const char *dir, const char *flags, const char *data) {
    if (dir[0] != '/' || strstr(dir, "..")) {
        errno = 0;
        die("bad tmpfs directory %s", dir);
    }
    if (mkdir(dir, 0700) != 0)
        die("cannot make %s", dir);
    if (mount("tmpfs", dir, "tmpfs", (unsigned long)number(flags, ULONG_MAX, "mount flags"), data) != 0)
        die("cannot mount a tmpfs on %s (%s)", dir, data);
}

static int netns_made = 0;

static void new_netns(void) {
    if (unshare(CLONE_NEWNET) != 0)
        die("cannot make a network namespace");
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) != 0)
        die("cannot read the flags of lo");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) != 0)
        die("cannot bring up lo");
    close(s);
    netns_made = 1;
}

static void net_sysctl(const char *key, const char *value) {
    char path[PATH_MAX];
    errno = 0;
    if (!netns_made)
        die("--sysctl %s before --netns", key);
    if (strncmp(key, "net.", 4) != 0 || strchr(key, '/') || strstr(key, ".."))
        die("bad sysctl %s", key);
    if (snprintf(path, sizeof path, "/proc/sys/%s", key) >= (int)sizeof path)
        die("sysctl too long: %s", key);
    for (char *c = path + strlen("/proc/sys/"); *c; c++)
        if (*c == '.')
            *c = '/';
    write_file(path, value);
}

static void become(const char *uid_text, const char *gid_text, char *group_list) {
    uid_t uid = (uid_t)number(uid_text, UINT_MAX - 1, "uid");
    gid_t gid = (gid_t)number(gid_text, UINT_MAX - 1, "gid");
    gid_t groups[MAX_GROUPS];
    size_t ngroups = 0;
    char *item, *list = group_list;
    while ((item = strsep(&list, ",")) != NULL) {
        if (ngroups == MAX_GROUPS) {
            errno = 0;
            die("too many groups");
        }
        groups[ngroups++] = (gid_t)number(item, UINT_MAX - 1, "group");
    }
    if (setgroups(ngroups, groups) != 0)
        die("setgroups");
    if (setresgid(gid, gid, gid) != 0)
        die("setresgid %s", gid_text);
    if (setresuid(uid, uid, uid) != 0)
        die("setresuid %s", uid_text);
    uid_t r, e, s;
    gid_t gr, ge, gs;
    if (getresuid(&r, &e, &s) || getresgid(&gr, &ge, &gs) || r != uid || e != uid || s != uid || gr != gid ||
        ge != gid || gs != gid || (uid != 0 && setuid(0) == 0)) {
        errno = 0;
        die("the user did not change to %s", uid_text);
    }
}

/* -- the sandbox part ----------------------------------------------------------------------- */
enum kind { RO_BIND, BIND, PROC, DEV, MQUEUE, TMPFS, REMOUNT_RO };
struct op {
    enum kind kind;
    const char *src, *dst;
};
static struct op ops[MAX_OPS];
static size_t nops = 0;
static char **env; /* room for every --setenv, PWD and the NULL: argc + 2 */
static size_t nenv = 0;
static int clone_flags = 0, as_pid_1 = 0, new_session = 0, die_with_parent = 0, caps_dropped = 0;
static int seccomp_fd = -1, info_fd = -1;
static long sandbox_uid = -1, sandbox_gid = -1;
static const char *hostname = NULL, *cwd = "/";

#define OLD "/oldroot"
#define NEW "/newroot"

/* NAME=VALUE into the environment, in place of an earlier NAME's (as setenv(3), as bubblewrap). */
static void put_env(char *pair) {
    size_t name = strcspn(pair, "=") + 1;
    for (size_t i = 0; i < nenv; i++)
        if (strncmp(env[i], pair, name) == 0) {
            env[i] = pair;
            return;
        }
    env[nenv++] = pair;
}

static void add_op(enum kind kind, const char *src, const char *dst) {
    if (nops == MAX_OPS || dst[0] != '/' || (src && src[0] != '/')) {
        errno = 0;
        die("bad mount %s", dst);
    }
    ops[nops++] = (struct op){kind, src, dst};
}

static void path_in(char *out, const char *root, const char *path) {
    if (snprintf(out, PATH_MAX, "%s%s", root, strcmp(path, "/") == 0 ? "" : path) >= PATH_MAX) {
        errno = 0;
        die("path too long: %s", path);
    }
}

/* DST made when missing (a directory, or an empty file for a file's bind), its parents too. */
static void ensure(const char *dst, int directory) {
    struct stat st;
    if (lstat(dst, &st) == 0)
        return;
    char parent[PATH_MAX];
    strcpy(parent, dst);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = '\0';
        ensure(parent, 1);
    }
    if (directory ? mkdir(dst, 0755) : mknod(dst, S_IFREG | 0444, 0))
        if (errno != EEXIST)
            die("cannot make the mount point %s", dst);
}

/* The flags a remount must keep (a bind of a host mount: its nosuid, nodev, noexec and atime
 * flags are locked in a user namespace), as runc reads them. */
static unsigned long kept_flags(const char *path) {
    struct statvfs sv;
    if (statvfs(path, &sv) != 0)
        die("statvfs %s", path);
    unsigned long flags = 0;
    if (sv.f_flag & ST_NOSUID)
        flags |= MS_NOSUID;
    if (sv.f_flag & ST_NODEV)
        flags |= MS_NODEV;
    if (sv.f_flag & ST_NOEXEC)
        flags |= MS_NOEXEC;
    if (sv.f_flag & ST_NOATIME)
        flags |= MS_NOATIME;
    if (sv.f_flag & ST_NODIRATIME)
        flags |= MS_NODIRATIME;
    if (sv.f_flag & ST_RELATIME)
        flags |= MS_RELATIME;
    return flags;
}

static void remount(const char *path, unsigned long flags) {
    if (mount(path, path, NULL, MS_REMOUNT | MS_BIND | flags | kept_flags(path), NULL) != 0)
        die("cannot remount %s", path);
}

static void remount_ro(const char *path) { remount(path, MS_RDONLY); }

/* A bind is nosuid and nodev (read-only too for --ro-bind), as bubblewrap's are. */
static void bind_path(const char *src, const char *dst, int readonly) {
    struct stat st;
    if (stat(src, &st) != 0)
        die("cannot bind %s", src);
    ensure(dst, S_ISDIR(st.st_mode));
    if (mount(src, dst, NULL, MS_BIND | MS_REC, NULL) != 0)
        die("cannot bind %s on %s", src, dst);
    remount(dst, MS_NOSUID | MS_NODEV | (readonly ? MS_RDONLY : 0));
}

/* A --dev's tmpfs. Mounted in the sandbox's user namespace, which maps only the sandbox's uid,
 * it is that user's (uid=0 is EINVAL there, unmapped; an owner not mapped would read as 65534
 * inside anyway; bubblewrap's, run as 65534, is 65534's too), so the owner's rights are voided
 * instead: it is remounted read-only once every --dev and what later ops put under it
 * (/dev/mqueue's mount point) are made (set_up_mounts), and it is capped. Uncapped it was half
 * the RAM (12 GiB, 3,085,471 inodes here) and rw: the finding's sandbox code made 200,000 files
 * in it in 3.9 s (issue 52, finding 8). It holds the root, 6 nodes, 6 links, shm, pts and
 * mqueue: 16 inodes (statvfs), no data pages (short links are kept in the inode). */
#define DEV_TMPFS "mode=0755,size=64k,nr_inodes=64"
#define MAX_DEVS 4
static char devs[MAX_DEVS][PATH_MAX];
static size_t ndevs = 0;

static void make_dev(const char *dev) {
    static const char *nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
    static const char *links[][2] = {{"stdin", "/proc/self/fd/0"}, {"stdout", "/proc/self/fd/1"},
                                     {"stderr", "/proc/self/fd/2"}, {"fd", "/proc/self/fd"},
                                     {"core", "/proc/kcore"},       {"ptmx", "pts/ptmx"}};
    char path[PATH_MAX], host[PATH_MAX];
    if (ndevs == MAX_DEVS) {
        errno = 0;
        die("too many --dev");
    }
    strcpy(devs[ndevs++], dev); /* shorter than PATH_MAX (path_in) */
    ensure(dev, 1);
    if (mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV, DEV_TMPFS) != 0)
        die("cannot mount a tmpfs on %s", dev);
    for (size_t i = 0; i < sizeof nodes / sizeof *nodes; i++) {
        joined(path, dev, nodes[i]);
        snprintf(host, sizeof host, OLD "/dev/%s", nodes[i]);
        if (mknod(path, S_IFREG | 0666, 0) != 0 || mount(host, path, NULL, MS_BIND | MS_REC, NULL) != 0)
            die("cannot make %s", path);
        remount(path, MS_NOSUID);
    }
    for (size_t i = 0; i < sizeof links / sizeof *links; i++) {
        joined(path, dev, links[i][0]);
        if (symlink(links[i][1], path) != 0)
            die("cannot link %s", path);
    }
    joined(path, dev, "shm");
    if (mkdir(path, 0755) != 0)
        die("cannot make %s", path);
    joined(path, dev, "pts");
    if (mkdir(path, 0755) != 0 ||
        mount("devpts", path, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620") != 0)
        die("cannot mount devpts on %s", path);
}

static void make_proc(const char *proc) {
    static const char *readonly[] = {"sys", "sysrq-trigger", "irq", "bus"}; /* as bwrap's --proc */
    char path[PATH_MAX];
    ensure(proc, 1);
    if (mount("proc", proc, "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL) != 0)
        die("cannot mount proc on %s", proc);
    for (size_t i = 0; i < sizeof readonly / sizeof *readonly; i++) {
        joined(path, proc, readonly[i]);
        if (access(path, F_OK) != 0)
            continue;
        if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) != 0)
            die("cannot bind %s", path);
        remount_ro(path);
    }
}

static void set_up_mounts(void) {
    char src[PATH_MAX], dst[PATH_MAX];
    /* nothing of ours propagates to the host; the host's unmounts still reach us */
    if (mount(NULL, "/", NULL, MS_SLAVE | MS_REC, NULL) != 0)
        die("cannot make / a slave");
    /* a scratch root: the old one below it at /oldroot, the sandbox's built at /newroot */
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k") != 0)
        die("cannot mount the scratch root");
    if (mkdir("/tmp" NEW, 0755) != 0 || mkdir("/tmp" OLD, 0755) != 0)
        die("cannot make the scratch root's directories");
    if (syscall(SYS_pivot_root, "/tmp", "/tmp" OLD) != 0 || chdir("/") != 0)
        die("cannot pivot to the scratch root");
    for (size_t i = 0; i < nops; i++) {
        struct op *op = &ops[i];
        path_in(dst, NEW, op->dst);
        switch (op->kind) {
        case RO_BIND:
        case BIND:
            path_in(src, OLD, op->src);
            bind_path(src, dst, op->kind == RO_BIND);
            break;
        case PROC:
            make_proc(dst);
            break;
        case DEV:
            make_dev(dst);
            break;
        case MQUEUE:
            ensure(dst, 1);
            if (mount("mqueue", dst, "mqueue", 0, NULL) != 0)
                die("cannot mount mqueue on %s", dst);
            break;
        case TMPFS:
            ensure(dst, 1);
            if (mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") != 0)
                die("cannot mount a tmpfs on %s", dst);
            break;
        case REMOUNT_RO:
            remount_ro(dst);
            break;
        }
    }
    /* each /dev read-only (this mount only: its devices, pts, shm and mqueue stay as they are) */
    for (size_t i = 0; i < ndevs; i++)
        remount_ro(devs[i]);
    /* the old root goes (private first: its unmount must not reach the host), then the scratch */
    if (mount(OLD, OLD, NULL, MS_REC | MS_PRIVATE, NULL) != 0 || umount2(OLD, MNT_DETACH) != 0)
        die("cannot detach the host's root");
    if (chdir(NEW) != 0 || syscall(SYS_pivot_root, ".", ".") != 0 || umount2(".", MNT_DETACH) != 0 || chdir("/") != 0)
        die("cannot pivot to the sandbox's root");
}

static void drop_capabilities(void) {
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
            die("cannot drop capability %d from the bounding set", cap);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        die("cannot clear the ambient capabilities");
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) != 0)
        die("cannot drop the capabilities");
}

static void load_seccomp(void) {
    static struct sock_filter filter[MAX_FILTER];
    size_t got = 0;
    ssize_t n;
    while ((n = read(seccomp_fd, (char *)filter + got, sizeof filter - got)) > 0)
        got += (size_t)n;
    if (n < 0 || got == 0 || got % sizeof *filter || got == sizeof filter) {
        errno = n < 0 ? errno : 0;
        die("bad seccomp program on fd %d (%zu bytes)", seccomp_fd, got);
    }
    close(seccomp_fd);
    struct sock_fprog prog = {(unsigned short)(got / sizeof *filter), filter};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
        die("cannot load the seccomp program");
}

/* The sandbox's PID 1: set up, then PROGRAM. `alive`: read end of a pipe the monitor holds
 * open (closed: the monitor died before PR_SET_PDEATHSIG took). */
static void sandbox(int alive, char **program) {
    char map[64];
    stage = "sandloop-start (sandbox)";
    if (die_with_parent && prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
        die("PR_SET_PDEATHSIG");
    struct pollfd p = {alive, POLLIN, 0};
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)))
        _exit(125);
    close(alive);
    if (clone_flags & CLONE_NEWUSER) { /* the user and group map to themselves, nothing else */
        /* the change of user made this process undumpable: /proc/self would be root's to write */
        if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0)
            die("PR_SET_DUMPABLE");
        write_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof map, "%ld %ld 1", sandbox_uid, sandbox_uid);
        write_file("/proc/self/uid_map", map);
        snprintf(map, sizeof map, "%ld %ld 1", sandbox_gid, sandbox_gid);
        write_file("/proc/self/gid_map", map);
    }
    set_up_mounts();
    if (hostname && sethostname(hostname, strlen(hostname)) != 0)
        die("cannot set the hostname");
    if (new_session && setsid() < 0)
        die("setsid");
    if (chdir(cwd) != 0)
        die("cannot change to %s", cwd);
    size_t len = strlen("PWD=") + strlen(cwd) + 1; /* as bubblewrap sets it */
    char *pwd = malloc(len);
    if (!pwd)
        die("malloc");
    snprintf(pwd, len, "PWD=%s", cwd);
    put_env(pwd);
    if (caps_dropped)
        drop_capabilities();
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        die("PR_SET_NO_NEW_PRIVS");
    if (seccomp_fd >= 0)
        load_seccomp();
    env[nenv] = NULL;
    environ = env;
    execvp(program[0], program);
    die("cannot execute %s", program[0]);
}

static int parse_sandbox_op(char **argv, int i, int argc) {
#define NEED(n)                                                                                              \
    do {                                                                                                     \
        if (i + (n) >= argc) {                                                                               \
            errno = 0;                                                                                       \
            die("%s needs %d argument(s)", argv[i], n);                                                      \
        }                                                                                                    \
    } while (0)
    const char *o = argv[i];
    if (strcmp(o, "--unshare-user") == 0)
        clone_flags |= CLONE_NEWUSER;
    else if (strcmp(o, "--unshare-pid") == 0)
        clone_flags |= CLONE_NEWPID;
    else if (strcmp(o, "--unshare-net") == 0)
        clone_flags |= CLONE_NEWNET;
    else if (strcmp(o, "--unshare-ipc") == 0)
        clone_flags |= CLONE_NEWIPC;
    else if (strcmp(o, "--unshare-uts") == 0)
        clone_flags |= CLONE_NEWUTS;
    else if (strcmp(o, "--unshare-cgroup") == 0)
        clone_flags |= CLONE_NEWCGROUP;
    else if (strcmp(o, "--die-with-parent") == 0)
        die_with_parent = 1;
    else if (strcmp(o, "--as-pid-1") == 0)
        as_pid_1 = 1;
    else if (strcmp(o, "--new-session") == 0)
        new_session = 1;
    else if (strcmp(o, "--clearenv") == 0)
        nenv = 0;
    else if (strcmp(o, "--proc") == 0 || strcmp(o, "--dev") == 0 || strcmp(o, "--mqueue") == 0 ||
             strcmp(o, "--tmpfs") == 0 || strcmp(o, "--remount-ro") == 0) {
        NEED(1);
        enum kind k = o[2] == 'p' ? PROC : o[2] == 'd' ? DEV : o[2] == 'm' ? MQUEUE : o[2] == 't' ? TMPFS : REMOUNT_RO;
        add_op(k, NULL, argv[i + 1]);
        return i + 2;
    } else if (strcmp(o, "--ro-bind") == 0 || strcmp(o, "--bind") == 0) {
        NEED(2);
        add_op(o[2] == 'r' ? RO_BIND : BIND, argv[i + 1], argv[i + 2]);
        return i + 3;
    } else if (strcmp(o, "--setenv") == 0) {
        NEED(2);
        size_t len = strlen(argv[i + 1]) + strlen(argv[i + 2]) + 2;
        char *pair = malloc(len);
        if (!pair)
            die("malloc");
        snprintf(pair, len, "%s=%s", argv[i + 1], argv[i + 2]);
        put_env(pair);
        return i + 3;
    } else {
        NEED(1);
        const char *v = argv[i + 1];
        if (strcmp(o, "--uid") == 0)
            sandbox_uid = (long)number(v, UINT_MAX - 1, "--uid");
        else if (strcmp(o, "--gid") == 0)
            sandbox_gid = (long)number(v, UINT_MAX - 1, "--gid");
        else if (strcmp(o, "--hostname") == 0)
            hostname = v;
        else if (strcmp(o, "--chdir") == 0)
            cwd = v;
        else if (strcmp(o, "--seccomp") == 0)
            seccomp_fd = (int)number(v, INT_MAX, "--seccomp");
        else if (strcmp(o, "--info-fd") == 0)
            info_fd = (int)number(v, INT_MAX, "--info-fd");
        else if (strcmp(o, "--cap-drop") == 0) {
            if (strcmp(v, "ALL") != 0) {
                errno = 0;
                die("only --cap-drop ALL is known");
            }
            caps_dropped = 1;
        } else {
            errno = 0;
            die("unknown option %s", o);
        }
        return i + 2;
    }
    return i + 1;
#undef NEED
}

int main(int argc, char **argv) {
    int i = 1, user_done = 0;
    pid_t parent = getppid();
    env = calloc((size_t)argc + 2, sizeof *env); /* each --setenv takes 3 arguments: never more */
    if (!env)
        die("calloc");
    /* the host part, in order, up to --user */
    while (i < argc && !user_done) {
        const char *o = argv[i];
        int left = argc - i - 1;
        if (strcmp(o, "--") == 0)
            break;
#define TAKES(n)                                                                                             \
    if (left < (n)) {                                                                                        \
        errno = 0;                                                                                           \
        die("%s needs %d argument(s)", o, n);                                                                \
    }
        if (strcmp(o, "--cgroup") == 0) {
            TAKES(1);
            make_cgroup(argv[i + 1]);
            i += 2;
        } else if (strcmp(o, "--set") == 0) {
            TAKES(2);
            set_cgroup(argv[i + 1], argv[i + 2]);
            i += 3;
        } else if (strcmp(o, "--join") == 0) {
            join_cgroups();
            i += 1;
        } else if (strcmp(o, "--mount-tmpfs") == 0) {
            TAKES(3);
            mount_host_tmpfs(argv[i + 1], argv[i + 2], argv[i + 3]);
            i += 4;
        } else if (strcmp(o, "--rlimit") == 0) {
            TAKES(3);
            struct rlimit limit = {number(argv[i + 2], ULLONG_MAX, "soft limit"),
                                   number(argv[i + 3], ULLONG_MAX, "hard limit")};
            if (setrlimit((int)number(argv[i + 1], RLIMIT_NLIMITS - 1, "resource"), &limit) != 0)
                die("setrlimit %s", argv[i + 1]);
            i += 4;
        } else if (strcmp(o, "--netns") == 0) {
            new_netns();
            i += 1;
        } else if (strcmp(o, "--sysctl") == 0) {
            TAKES(2);
            net_sysctl(argv[i + 1], argv[i + 2]);
            i += 3;
        } else if (strcmp(o, "--user") == 0) {
            TAKES(3);
            become(argv[i + 1], argv[i + 2], argv[i + 3]);
            user_done = 1;
            i += 4;
        } else {
            errno = 0;
            die("unknown host option %s (--user UID GID GROUPS ends the host part)", o);
        }
#undef TAKES
    }
    if (!user_done) {
        errno = 0;
        die("no --user: a sandbox never runs as the caller");
    }
    while (i < argc && strcmp(argv[i], "--") != 0)
        i = parse_sandbox_op(argv, i, argc);
    if (i + 1 >= argc) {
        errno = 0;
        die("no PROGRAM after --");
    }
    char **program = argv + i + 1;
    errno = 0;
    if (!as_pid_1 || !(clone_flags & CLONE_NEWPID))
        die("only --as-pid-1 with --unshare-pid is supported");
    if ((clone_flags & CLONE_NEWUSER) && (sandbox_uid < 0 || sandbox_gid < 0))
        die("--unshare-user needs --uid and --gid");
    if (sandbox_uid >= 0 && ((uid_t)sandbox_uid != getuid() || (gid_t)sandbox_gid != getgid()))
        die("--uid/--gid must be --user's (the namespace maps them to themselves)");
    /* as bubblewrap's monitor: no privilege can be gained by anything this process executes */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        die("PR_SET_NO_NEW_PRIVS");
    /* this process dies with its parent (the setting does not survive the change of user) */
    if (die_with_parent && (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent))
        die("the caller is gone");
    int alive[2], exec_pipe[2];
    if (pipe2(alive, O_CLOEXEC) != 0 || pipe2(exec_pipe, O_CLOEXEC) != 0)
        die("pipe");
    pid_t child = (pid_t)syscall(SYS_clone, (unsigned long)(clone_flags | CLONE_NEWNS | SIGCHLD), NULL, NULL, NULL, NULL);
    if (child < 0)
        die("cannot make the sandbox's namespaces");
    if (child == 0) {
        close(alive[1]);
        close(exec_pipe[0]);
        if (info_fd >= 0)
            close(info_fd);
        /* close-on-exec: the monitor reads EOF once PROGRAM runs, a byte if the set-up failed */
        report_fd = exec_pipe[1];
        sandbox(alive[0], program);
    }
    close(alive[0]);
    close(exec_pipe[1]);
    if (seccomp_fd >= 0)
        close(seccomp_fd);
    char byte;
    ssize_t said;
    while ((said = read(exec_pipe[0], &byte, 1)) < 0 && errno == EINTR)
        ;
    close(exec_pipe[0]);
    int status;
    pid_t done = 0;
    if (info_fd >= 0) {
        if (said == 0) { /* it runs PROGRAM (a failed set-up said so: then nothing is written) */
            char info[64];
            int len = snprintf(info, sizeof info, "{\"child-pid\": %d}\n", (int)child);
            if (write(info_fd, info, (size_t)len) != len)
                die("cannot write the info fd");
        }
        close(info_fd);
    }
    if (done == 0) {
        while ((done = waitpid(child, &status, 0)) < 0 && errno == EINTR)
            ;
    }
    if (done < 0)
        die("waitpid");
    close(alive[1]);
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}
