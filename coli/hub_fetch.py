"""Resumable downloads of the large files of a `coli pull` (safetensors shards, GGUF files).

huggingface_hub 2.x downloads each file into a temporary name unique to the process and
deletes it when the download fails outright, so a pull stopped by a full disk (or a lost
network) starts every large file again from zero. coli fetches these files itself, before
``snapshot_download`` handles the rest, into the Hugging Face cache's own layout:

    models--ORG--NAME/blobs/<etag>.incomplete   the bytes so far (kept when a pull fails)
    models--ORG--NAME/blobs/<etag>              the finished file, renamed from the above

The next pull continues the ``.incomplete`` file with an HTTP Range request (its bytes are
checked against the etag's sha256 when it was resumed from an earlier pull), and
``snapshot_download`` then finds the blob complete and only links it into ``snapshots/``.
Nothing is linked into a snapshot until it is whole.
"""
from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import re
from pathlib import Path
from urllib.parse import urlparse

from coli.errors import ModelLoadError

LARGE = (".safetensors", ".gguf")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def large_files(files: list[str], patterns: list[str]) -> list[str]:
    """Those of the repository's ``files`` matching ``patterns`` that this module fetches itself."""
    return sorted(f for f in files if f.endswith(LARGE) and any(fnmatch.fnmatch(f, p) for p in patterns))


def blob_dir(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "blobs"


def fetch(repo: str, filename: str, revision: str | None, name: str) -> Path:
    """``filename`` of ``repo`` as a complete blob in the cache (downloaded or resumed as needed)."""
    import huggingface_hub as hf
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf.hf_hub_url(repo, filename, revision=revision)
    headers = build_hf_headers()
    meta = hf.get_hf_file_metadata(url, headers=headers)
    if not meta.etag:
        raise ModelLoadError(f"{name}: the hub sent no ETag for {filename}; is HF_ENDPOINT a Hugging Face hub?")
    blob = blob_dir(repo) / meta.etag
    if blob.exists():
        return blob
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(blob.name + ".incomplete")
    have = part.stat().st_size if part.exists() else 0
    if meta.size is not None and have > meta.size:  # not the file the hub has now
        part.unlink()
        have = 0
    location = meta.location or url
    if urlparse(location).netloc != urlparse(url).netloc:  # a CDN: the token is for the hub only
        headers.pop("authorization", None)
    try:
        with open(part, "ab") as f:
            http_get(location, f, resume_size=have, headers=headers, expected_size=meta.size,
                     displayed_filename=filename)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            kept = part.stat().st_size if part.exists() else 0
            raise ModelLoadError(f"{name}: disk full while downloading {filename} ({_mb(kept)} of {_mb(meta.size)} "
                                 f"kept in {part.parent} to resume): free space and run coli pull {name} again") from None
        raise
    if have and SHA256.match(meta.etag) and _sha256(part) != meta.etag:
        part.unlink()
        raise ModelLoadError(f"{name}: {filename} resumed from an earlier pull does not match the hub's checksum "
                             f"(removed): run coli pull {name} again")
    os.replace(part, blob)
    return blob


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
