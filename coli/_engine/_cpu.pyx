# cython: language_level=3
"""What this CPU can run: the instruction-set extensions that the SIMD paths of the
kernels need, from CPUID and XGETBV (the operating system must also save the wider
registers) on x86, from the kernel's HWCAP bits or macOS's sysctls on 64-bit ARM
(cpu_arm.h). Compiled for the baseline of the platform, so it runs on every CPU; it is
imported before any kernel module (see kernels.py)."""

cdef extern from *:
    """
    #include <string.h>
    #if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
    #if defined(_MSC_VER)
    #include <intrin.h>
    static void coli_cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
        int v[4]; __cpuidex(v, (int)leaf, (int)sub);
        r[0] = v[0], r[1] = v[1], r[2] = v[2], r[3] = v[3];
    }
    static unsigned long long coli_xgetbv(void) { return _xgetbv(0); }
    #else
    #include <cpuid.h>
    static void coli_cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
        __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    }
    static unsigned long long coli_xgetbv(void) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        return ((unsigned long long)hi << 32) | lo;
    }
    #endif
    #define COLI_X86 1
    /* Bit i of the result: feature i of coli_cpu_names (in _cpu.pyx). */
    static unsigned coli_cpu_features(void) {
        unsigned r[4], max_leaf, f = 0;
        unsigned long long xcr0 = 0;
        coli_cpuid(0, 0, r);
        max_leaf = r[0];
        if (max_leaf < 1) return 0;
        coli_cpuid(1, 0, r);
        unsigned ecx1 = r[2];
        int osxsave = (ecx1 >> 27) & 1;
        if (osxsave) xcr0 = coli_xgetbv();
        int avx_os = osxsave && (xcr0 & 0x6) == 0x6;          /* XMM and YMM state */
        int avx512_os = avx_os && (xcr0 & 0xE0) == 0xE0;      /* opmask, ZMM_Hi256, Hi16_ZMM */
        if (avx_os && ((ecx1 >> 28) & 1)) f |= 1u << 0;       /* avx */
        if (avx_os && ((ecx1 >> 12) & 1)) f |= 1u << 1;       /* fma */
        if (avx_os && ((ecx1 >> 29) & 1)) f |= 1u << 2;       /* f16c */
        if (max_leaf >= 7) {
            coli_cpuid(7, 0, r);
            unsigned ebx = r[1], ecx = r[2], max_sub = r[0];
            if (avx_os && ((ebx >> 5) & 1)) f |= 1u << 3;     /* avx2 */
            if (avx512_os) {
                if ((ebx >> 16) & 1) f |= 1u << 4;            /* avx512f */
                if ((ebx >> 17) & 1) f |= 1u << 5;            /* avx512dq */
                if ((ebx >> 28) & 1) f |= 1u << 6;            /* avx512cd */
                if ((ebx >> 30) & 1) f |= 1u << 7;            /* avx512bw */
                if ((ebx >> 31) & 1) f |= 1u << 8;            /* avx512vl */
                if ((ecx >> 11) & 1) f |= 1u << 9;            /* avx512vnni */
                if (max_sub >= 1) {
                    coli_cpuid(7, 1, r);
                    if ((r[0] >> 5) & 1) f |= 1u << 10;       /* avx512bf16 */
                }
            }
            if (avx_os && max_sub >= 1) {
                coli_cpuid(7, 1, r);
                if ((r[0] >> 4) & 1) f |= 1u << 11;           /* avxvnni */
            }
        }
        return f;
    }
    /* The vendor string of CPUID leaf 0 ("GenuineIntel", "AuthenticAMD", ...) into out[13]. */
    static void coli_cpu_vendor(char *out) {
        unsigned r[4];
        coli_cpuid(0, 0, r);
        memcpy(out, &r[1], 4);
        memcpy(out + 4, &r[3], 4);
        memcpy(out + 8, &r[2], 4);
        out[12] = 0;
    }
    #else
    #define COLI_X86 0
    static void coli_cpu_vendor(char *out) { out[0] = 0; }
    #include "cpu_arm.h"
    /* 64-bit ARM: NEON, sdot, smmla as bits 12-14 (0 elsewhere) */
    static unsigned coli_cpu_features(void) { return coli_arm_features() << 12; }
    #endif
    """
    unsigned coli_cpu_features()
    void coli_cpu_vendor(char *out)
    int COLI_X86

NAMES = ("avx", "fma", "f16c", "avx2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
         "avx512vnni", "avx512bf16", "avxvnni", "asimd", "asimddp", "i8mm")


def features():
    """The set of NAMES this CPU (and operating system) supports; empty off x86 and aarch64."""
    cdef unsigned f = coli_cpu_features()
    return frozenset(n for i, n in enumerate(NAMES) if f >> i & 1)


def is_x86():
    return bool(COLI_X86)


def vendor():
    """CPUID's vendor string ("GenuineIntel", "AuthenticAMD", ...); empty off x86."""
    cdef char out[13]
    coli_cpu_vendor(out)
    return out[:12].decode("ascii", "replace").rstrip("\x00")
