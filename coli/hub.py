"""Models by name: Hugging Face hub ids, resolved from the local cache, and `coli pull`.

``-m Qwen/Qwen3-0.6B`` (or ``NAME@revision``) is looked up in the Hugging Face cache
that transformers shares (``HF_HOME`` / ``HF_HUB_CACHE``) without touching the
network, and in coli's own directory of converted models (``$COLI_HOME/models``,
default ``~/.cache/coli/models``). Nothing is downloaded implicitly: a name that is not
cached is one line saying ``run: coli pull NAME``. ``pull`` downloads through
``huggingface_hub`` (progress bars, resume, ``HF_TOKEN``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``) only what coli loads: config, tokenizer and safetensors files,
or the one GGUF file asked for with ``--file``; the large files through coli's own
resumable download (``coli/hub_fetch.py``), so a pull stopped by a full disk or a lost
network continues where it stopped.
"""
from __future__ import annotations

import difflib
import errno
import os
import re
from pathlib import Path

from coli.errors import ModelLoadError

REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w./-]+))?$")
NEEDED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]


def coli_home() -> Path:
    return Path(os.environ.get("COLI_HOME") or Path.home() / ".cache" / "coli").expanduser()


def converted_dir(repo: str, quant: str) -> Path:
    """Where ``coli pull REPO --quant Q`` puts its converted model."""
    return coli_home() / "models" / f"{repo.replace('/', '--')}--{quant}"


def parse_name(name: str) -> tuple[str, str | None] | None:
    """(repo, revision) of a hub name like ``org/model@rev``, None for anything else."""
    m = REPO_ID.match(name)
    return (m["repo"], m["rev"]) if m else None


def cached_snapshot(repo: str, revision: str | None = None) -> Path | None:
    """The repo's snapshot directory in the local Hugging Face cache, or None; reads only
    the cache's refs/ and snapshots/ (never the network)."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    rev = revision or "main"
    ref = root / "refs" / rev
    try:
        commit = ref.read_text().strip() if ref.is_file() else rev
    except OSError:
        return None
    snap = root / "snapshots" / commit
    return snap if snap.is_dir() and any(snap.iterdir()) else None


def model_path(snapshot: Path) -> Path:
    """What to load from a snapshot: the directory, or its one GGUF when it holds no config.json."""
    if (snapshot / "config.json").exists():
        return snapshot
    ggufs = sorted(p for p in snapshot.rglob("*.gguf") if "-of-" not in p.name or "-00001-of-" in p.name)
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelLoadError(f"{snapshot}: holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
                             "pass one of them with -m PATH")
    return snapshot


def resolve_name(name: str) -> Path:
    """A path as given when it exists; else a hub name from the local cache (converted
    first); else ModelLoadError with what to run, or the closest known name."""
    p = Path(name).expanduser()
    if p.exists():
        return p
    parsed = parse_name(name)
    if parsed is None or name.startswith((".", "/", "~")):
        close = closest(name)
        if close:
            raise ModelLoadError(f"{name}: no such model or path; did you mean {close}?")
        return p
    repo, rev = parsed
    if rev is None:
        for conv in sorted((coli_home() / "models").glob(f"{repo.replace('/', '--')}--*")):
            if (conv / "coli.json").exists():
                return conv
    snap = cached_snapshot(repo, rev)
    if snap is not None:
        return model_path(snap)
    close = closest(name)
    hint = f"; did you mean {close}?" if close and close != name else ""
    raise ModelLoadError(f"{name}: not in the local Hugging Face cache (run: coli pull {name}){hint}")


def known_names() -> list[str]:
    """Names of every model in the local caches (what ``coli list`` shows)."""
    from coli.models_cache import scan

    return [m["name"] for m in scan(fit=False)]


def closest(name: str) -> str | None:
    try:
        names = known_names()
    except Exception:  # a broken cache must not hide the user's own error
        return None
    lower = {n.lower(): n for n in names}
    hit = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return lower[hit[0]] if hit else None


def _hub_error(e: BaseException, name: str) -> ModelLoadError:
    """One line for a failed download."""
    from huggingface_hub import errors as E

    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return ModelLoadError(f"{name}: disk full while downloading (the files already complete stay cached): "
                              f"free space and run coli pull {name} again")
    if isinstance(e, (E.LocalEntryNotFoundError, E.OfflineModeIsEnabled)) or type(e).__name__ == "ConnectError":
        return ModelLoadError(f"{name}: cannot reach the hub (offline: HF_HUB_OFFLINE is set, or no network) "
                              "and it is not in the local cache")
    if isinstance(e, E.GatedRepoError):
        return ModelLoadError(f"{name}: a gated repository; accept its terms on the hub and set HF_TOKEN")
    if isinstance(e, E.RepositoryNotFoundError):
        return ModelLoadError(f"{name}: no such repository on the hub (or it is private: set HF_TOKEN)")
    if isinstance(e, E.RevisionNotFoundError):
        return ModelLoadError(f"{name}: no such revision on the hub")
    if isinstance(e, E.EntryNotFoundError):
        return ModelLoadError(f"{name}: no such file in the repository")
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ModelLoadError(f"{name}: download failed: {first}")


def pull(name: str, file: str | None = None, quant: str | None = None, progress: bool = True) -> Path:
    """Download ``name`` (``org/model[@rev]``) into the Hugging Face cache; with
    ``file`` only that GGUF (every part of a split one); with ``quant`` also convert it
    into coli's models directory. Returns the path ``-m`` will load."""
    import huggingface_hub as hf
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    from coli.hub_fetch import fetch, large_files

    parsed = parse_name(name)
    if parsed is None:
        raise ModelLoadError(f"{name}: not a hub name (expected ORG/MODEL or ORG/MODEL@REVISION)")
    repo, rev = parsed
    (enable_progress_bars if progress else disable_progress_bars)()
    hf.utils.logging.set_verbosity_error()  # its warnings are not one line; ours are
    try:
        if file:
            m = re.match(r"^(.*)-\d{5}-of-(\d{5})\.gguf$", file)
            patterns = [f"{m[1]}-*-of-{m[2]}.gguf"] if m else [file]
        else:
            patterns = NEEDED
        files = hf.list_repo_files(repo, revision=rev)
        if not file and "config.json" not in files:
            ggufs = sorted(f for f in files if f.endswith(".gguf"))
            hint = f"; it has GGUF files: pass --file, e.g. --file {ggufs[0]}" if ggufs else ""
            raise ModelLoadError(f"{name}: no config.json in the repository{hint}")
        for big in large_files(files, patterns):  # resumable across pulls (coli/hub_fetch.py)
            fetch(repo, big, rev, name)
        if file:
            snap = Path(hf.snapshot_download(repo, revision=rev, allow_patterns=patterns))
            target = snap / file
            if not target.exists():
                have = _repo_ggufs(repo, rev)
                raise ModelLoadError(f"{name}: no file {file} in the repository"
                                     + (f" (its GGUF files: {', '.join(have)})" if have else ""))
        else:
            snap = Path(hf.snapshot_download(repo, revision=rev, allow_patterns=patterns))
            if not (snap / "config.json").exists():
                ggufs = _repo_ggufs(repo, rev)
                hint = f"; it has GGUF files: pass --file, e.g. --file {ggufs[0]}" if ggufs else ""
                raise ModelLoadError(f"{name}: no config.json in the repository{hint}")
            if not list(snap.glob("*.safetensors")):
                raise ModelLoadError(f"{name}: no safetensors weights in the repository")
            target = snap
    except ModelLoadError:
        raise
    except (Exception, OSError) as e:  # huggingface_hub and requests raise many kinds
        raise _hub_error(e, name) from None
    if quant and quant not in ("f32",):
        from coli.weights.convert import convert

        out = converted_dir(repo, quant)
        convert(target, out, quant, force=True)
        return out
    return target


def _repo_ggufs(repo: str, rev: str | None) -> list[str]:
    import huggingface_hub as hf

    try:
        return sorted(f for f in hf.list_repo_files(repo, revision=rev) if f.endswith(".gguf"))
    except Exception:
        return []
