"""The `coli` command (coli/cli/main.py)."""
import os as _os
import sys as _sys

if _os.environ.get("COLI_SIMD") or _os.environ.get("COLI_STREAM_PREFETCH"):
    # A forced SIMD path this CPU or build lacks, or a stream-prefetch setting that is not one,
    # is a usage error: one line, exit 2 (the command modules import the kernels, so this must
    # be checked before they load).
    from coli._engine import dispatch as _dispatch

    try:
        if _os.environ.get("COLI_SIMD"):
            _dispatch.choose(_os.environ["COLI_SIMD"])
        _dispatch.stream_prefetch(vendor="")
    except _dispatch.SimdUnavailableError as _e:
        print(f"error: {_e}", file=_sys.stderr)
        raise SystemExit(2) from None
