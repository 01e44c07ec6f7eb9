/* What a 64-bit ARM CPU can run, for the run-time choice among the ARM paths of the kernels
 * (coli/_engine/_cpu.pyx, dispatch.py): bit 0 Advanced SIMD (NEON; always there on
 * aarch64), bit 1 the int8 dot product sdot (FEAT_DotProd), bit 2 the int8 matrix multiply
 * smmla (FEAT_I8MM). Linux: the kernel's HWCAP / HWCAP2 bits (getauxval); macOS: the
 * hw.optional.arm.FEAT_* sysctls; elsewhere NEON only. 0 off aarch64. */
#ifndef COLI_CPU_ARM_H
#define COLI_CPU_ARM_H

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef AT_HWCAP2
#define AT_HWCAP2 26
#endif
static unsigned coli_arm_features(void) {
    unsigned long h = getauxval(AT_HWCAP), h2 = getauxval(AT_HWCAP2);
    unsigned f = 0;
    if (h & (1ul << 1)) f |= 1u;   /* HWCAP_ASIMD */
    if (h & (1ul << 20)) f |= 2u;  /* HWCAP_ASIMDDP */
    if (h2 & (1ul << 13)) f |= 4u; /* HWCAP2_I8MM */
    return f;
}
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/types.h>
#include <sys/sysctl.h>
static int coli_arm_sysctl(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v;
}
static unsigned coli_arm_features(void) {
    return 1u | (coli_arm_sysctl("hw.optional.arm.FEAT_DotProd") ? 2u : 0u) |
           (coli_arm_sysctl("hw.optional.arm.FEAT_I8MM") ? 4u : 0u);
}
#elif defined(__aarch64__)
static unsigned coli_arm_features(void) { return 1u; }
#else
static unsigned coli_arm_features(void) { return 0u; }
#endif

#endif /* COLI_CPU_ARM_H */
