/* Preloaded by `python -m lab.avx2_only`: this process answers CPUID as an AVX2 CPU without AVX-512, VNNI or
 * AMX would (an AMD EPYC of Zen 2 or 3), so that ONNX Runtime, oneDNN, torch and numpy choose the kernels they
 * choose there.
 *
 * With CPUID faulting on (arch_prctl(ARCH_SET_CPUID, 0); the `cpuid_fault` flag in /proc/cpuinfo) every CPUID
 * this thread runs raises SIGSEGV; the handler runs the real CPUID with faulting briefly off, clears the feature
 * bits, and steps over the instruction. The setting passes to threads and forked children and ends at exec, so
 * each Python process the command starts turns it on again when it loads this library. Other programs (redis,
 * prometheus, chromium: no ONNX Runtime, no torch) are left alone. The program's own SIGSEGV handler (Python's
 * faulthandler) is kept aside and called for every fault that is not a CPUID. glibc reads CPUID before this
 * library loads, so its own string functions keep their AVX-512 versions; they compute no numbers.
 * AVX2_ONLY_REPORT=1 prints at exit how many CPUIDs each process had answered (a few dozen: no cost to time). */
#define _GNU_SOURCE
#include <cpuid.h>
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID 0x1012
#define BIT(n) (1u << (n))

/* leaf 7, subleaf 0: EBX avx512 f dq ifma pf er cd bw vl; ECX avx512 vbmi vbmi2 vnni bitalg vpopcntdq;
 * EDX avx512 4vnniw 4fmaps vp2intersect, amx_bf16, avx512_fp16, amx_tile, amx_int8 */
static const uint32_t L7S0_EBX = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
static const uint32_t L7S0_ECX = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14);
static const uint32_t L7S0_EDX = BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25);
/* leaf 7, subleaf 1: EAX avx_vnni, avx512_bf16, amx_fp16, avx_ifma; EDX avx_vnni_int8, avx_ne_convert,
 * amx_complex, avx_vnni_int16, avx10 */
static const uint32_t L7S1_EAX = BIT(4) | BIT(5) | BIT(21) | BIT(23);
static const uint32_t L7S1_EDX = BIT(4) | BIT(5) | BIT(8) | BIT(10) | BIT(19);

/* "AuthenticAMD" in leaf 0's EBX, EDX, ECX: libraries that choose by vendor (MKL) then choose as on an EPYC */
static int as_amd;
static const uint32_t AMD_VENDOR[3] = {0x68747541, 0x69746e65, 0x444d4163};

static struct sigaction kept; /* the program's SIGSEGV action, as it believes it is installed */
static int active;
static volatile unsigned long emulated;

static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);

static void cpuid_as_avx2(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    if (leaf == 0 && as_amd) {
        r[1] = AMD_VENDOR[0];
        r[3] = AMD_VENDOR[1];
        r[2] = AMD_VENDOR[2];
    } else if (leaf == 7 && sub == 0) {
        r[1] &= ~L7S0_EBX;
        r[2] &= ~L7S0_ECX;
        r[3] &= ~L7S0_EDX;
    } else if (leaf == 7 && sub == 1) {
        r[0] &= ~L7S1_EAX;
        r[3] &= ~L7S1_EDX;
    } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) { /* AMX tile and AVX10 leaves */
        r[0] = r[1] = r[2] = r[3] = 0;
    }
}

static void on_segv(int sig, siginfo_t *si, void *ctx) {
    ucontext_t *uc = ctx;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (si->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
        uint32_t r[4];
        int saved = errno;
        cpuid_as_avx2((uint32_t)g[REG_RAX], (uint32_t)g[REG_RCX], r);
        g[REG_RAX] = r[0];
        g[REG_RBX] = r[1];
        g[REG_RCX] = r[2];
        g[REG_RDX] = r[3];
        g[REG_RIP] += 2;
        emulated++;
        errno = saved;
        return;
    }
    if (kept.sa_handler == SIG_IGN || kept.sa_handler == SIG_DFL) {
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        real_sigaction(SIGSEGV, &dfl, NULL); /* the instruction faults again, now fatally */
        return;
    }
    if (kept.sa_flags & SA_SIGINFO)
        kept.sa_sigaction(sig, si, ctx);
    else
        kept.sa_handler(sig);
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction)
        real_sigaction = (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV || !active)
        return real_sigaction(sig, act, old);
    if (old)
        *old = kept;
    if (act)
        kept = *act;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act = {.sa_handler = handler, .sa_flags = SA_RESTART}, old;
    sigemptyset(&act.sa_mask);
    if (sigaction(sig, &act, &old) != 0)
        return SIG_ERR;
    return old.sa_handler;
}

static void report(void) {
    if (getenv("AVX2_ONLY_REPORT"))
        fprintf(stderr, "avx2_only: %d %lu CPUID answered\n", (int)getpid(), emulated);
}

__attribute__((constructor)) static void start(void) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return;
    exe[n] = 0;
    const char *base = strrchr(exe, '/');
    base = base ? base + 1 : exe;
    if (strncmp(base, "python", 6) != 0)
        return;
    real_sigaction = (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
    const char *vendor = getenv("AVX2_ONLY_VENDOR");
    as_amd = vendor != NULL && strcmp(vendor, "amd") == 0;
    struct sigaction act = {.sa_sigaction = on_segv, .sa_flags = SA_SIGINFO | SA_ONSTACK};
    sigemptyset(&act.sa_mask);
    if (real_sigaction(SIGSEGV, &act, &kept) != 0)
        return;
    if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
        real_sigaction(SIGSEGV, &kept, NULL);
        fprintf(stderr, "avx2_only: this CPU or kernel cannot fault on CPUID; nothing masked\n");
        return;
    }
    active = 1;
    atexit(report);
}
