#!/usr/bin/env bash
# The engine's own kernel tests on a real 64-bit ARM build of coli, under qemu-user, on an x86
# Debian machine: the whole extension (every ARM path setup.py builds: neoni8mm, neondot, neon,
# scalar) is cross-compiled with aarch64-linux-gnu-gcc against Debian's arm64 Python 3.11 and
# NumPy, and tests/test_kernels.py + tests/test_quant_formats.py run in the arm64 Python under
# qemu-aarch64: "-cpu max" (sdot, smmla) and "-cpu cortex-a53" (NEON only), so the run-time
# dispatch (HWCAP) is exercised too. tests/test_neon_qemu.py is the quick check of the kernels'
# C that CI runs; this is the slow, whole-engine one (~11 min on 2 busy cores, the download included).
#
#   sudo apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
#   tools/arm_qemu_engine.sh            # from a venv with the test extras and Cython installed
#
# Needs root once, to download ~25 MB of arm64 .debs (dpkg --add-architecture arm64 for the
# download only; removed again when it was not there before). Work files: $COLI_ARM_WORK
# (default /tmp/coli-arm). Uses the working tree (tracked and untracked, not ignored files).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${COLI_ARM_WORK:-/tmp/coli-arm}
SYSROOT=$WORK/root
SRC=$WORK/src
PYDEPS=$WORK/py
PKGS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev python3-numpy libc6
libexpat1 zlib1g libffi8 libbz2-1.0 liblzma5 libblas3 liblapack3 libgfortran5 libgcc-s1 libstdc++6 libgomp1
libssl3 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libnsl2 libtirpc3 libdb5.3"

for tool in aarch64-linux-gnu-gcc qemu-aarch64; do
    command -v $tool >/dev/null || { echo "no $tool: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user" >&2; exit 2; }
done

if [ ! -x "$SYSROOT/usr/bin/python3.11" ]; then
    added=0
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then dpkg --add-architecture arm64; added=1; fi
    apt-get update -qq
    mkdir -p "$WORK/debs"
    # shellcheck disable=SC2046
    (cd "$WORK/debs" && apt-get download $(for p in $PKGS; do echo "$p:arm64"; done))
    if [ $added = 1 ]; then dpkg --remove-architecture arm64 && apt-get update -qq; fi
    for d in "$WORK"/debs/*.deb; do dpkg -x "$d" "$SYSROOT"; done
    ln -sf blas/libblas.so.3 "$SYSROOT/usr/lib/aarch64-linux-gnu/libblas.so.3"      # Debian's alternatives
    ln -sf lapack/liblapack.so.3 "$SYSROOT/usr/lib/aarch64-linux-gnu/liblapack.so.3"
fi

# the working tree, built for aarch64 (setup.py believing it runs there)
rm -rf "$SRC" && mkdir -p "$SRC"
(cd "$ROOT" && git ls-files --cached --others --exclude-standard -z | xargs -0 tar -c --ignore-failed-read 2>/dev/null) | tar -x -C "$SRC"
(cd "$SRC" && CC=aarch64-linux-gnu-gcc LDSHARED="aarch64-linux-gnu-gcc -shared" \
    CFLAGS="-I$SYSROOT/usr/include -I$SYSROOT/usr/include/python3.11 -I$SYSROOT/usr/lib/python3/dist-packages/numpy/core/include" \
    python -c "import platform, sys; platform.machine = lambda: 'aarch64'; sys.argv = ['setup.py', '-q', 'build_ext', '--inplace']
exec(compile(open('setup.py').read(), 'setup.py', 'exec'))")
for f in "$SRC"/coli/_engine/*.so; do
    base=$(basename "$f"); mv "$f" "$SRC/coli/_engine/${base%%.*}.cpython-311-aarch64-linux-gnu.so"
done

# pytest and its pure-Python dependencies from this interpreter (NumPy comes from the arm64 root)
mkdir -p "$PYDEPS"
SP=$(python -c "import os, pytest; print(os.path.dirname(os.path.dirname(pytest.__file__)))")
for p in pytest _pytest pluggy iniconfig packaging pygments py.py; do
    if [ -e "$SP/$p" ]; then ln -sfn "$SP/$p" "$PYDEPS/$p"; fi
done

fail=0
run() { # qemu CPU model, COLI_SIMD path, pytest arguments
    local cpu=$1 path=$2
    shift 2
    echo "== qemu -cpu $cpu, COLI_SIMD=$path: $*"
    (cd "$SRC" && COLI_SIMD=$path PYTHONPATH="$SRC:$PYDEPS" qemu-aarch64 -cpu "$cpu" -L "$SYSROOT" \
        "$SYSROOT/usr/bin/python3.11" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -3) || fail=1
}
check="from coli._engine import kernels as K, dispatch; print(K.simd_name(), dispatch.runnable())"
echo "== dispatch: qemu -cpu max / cortex-a53"
(cd "$SRC" && PYTHONPATH="$SRC" qemu-aarch64 -cpu max -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -c "$check")
(cd "$SRC" && PYTHONPATH="$SRC" qemu-aarch64 -cpu cortex-a53 -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -c "$check")
# Left out: test_version_1_directories_read_int4_as_int4s and test_int8_prefill_and_decode_agree
# load a model, which needs the compiled `tokenizers` package (none for this arm64 Python here;
# the second one's point, a token's int8 result alone or in a batch, is tests/test_neon_qemu.py's
# bit-for-bit int8 check), and
# test_release_threads_retires_the_calling_threads_workers counts the OS threads in
# /proc/self/task, which under qemu-user lag behind the guest's (it passes, then fails at its
# second thread count).
skip="not version_1_directories and not int8_prefill_and_decode_agree and not release_threads_retires"
run max neoni8mm tests/test_kernels.py tests/test_quant_formats.py -k "$skip"
run max neondot tests/test_kernels.py tests/test_quant_formats.py -k "1thread and $skip"
run cortex-a53 neon tests/test_kernels.py tests/test_quant_formats.py -k "1thread and $skip"
run max scalar tests/test_kernels.py -k 1thread
exit $fail
