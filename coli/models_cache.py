"""The models on this machine (``coli list`` / ``show`` / ``rm``) and the running servers (``coli ps``).

Models: every repository in the Hugging Face cache (safetensors snapshots and pulled
GGUF files), every converted directory in ``$COLI_HOME/models``, and every GGUF file
loaded by path (``-m some/file.gguf``), remembered in ``$COLI_HOME/ggufs.json``
(rewritten atomically under a lock; entries whose file is gone are dropped). Described
from headers only (config.json, safetensors headers, GGUF metadata, coli.json): listing
never reads a weight.

Running servers: ``coli serve`` writes ``$COLI_HOME/run/<pid>.json`` once it listens
and removes it at exit; ``running()`` drops files whose process is gone.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from coli.errors import ModelLoadError
from coli.hub import coli_home, model_path


def _dir_size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _hf_entries() -> list[dict]:
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # no cache yet, or an unreadable one
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        try:
            path = model_path(Path(rev.snapshot_path))
        except ModelLoadError:
            path = Path(rev.snapshot_path)
        out.append({"name": repo.repo_id, "source": "huggingface", "path": str(path),
                    "repo_path": str(repo.repo_path), "size": repo.size_on_disk})
    return out


def _converted_entries() -> list[dict]:
    root = coli_home() / "models"
    out = []
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        if (d / "coli.json").exists():
            parts = d.name.split("--")
            name = "/".join(parts[:2]) + (f" ({parts[2]})" if len(parts) > 2 else "") if len(parts) >= 2 else d.name
            out.append({"name": name, "source": "converted", "path": str(d), "repo_path": str(d),
                        "size": _dir_size(d)})
    return out


# -- GGUF files loaded by path -------------------------------------------------------------------

def _registry() -> Path:
    return coli_home() / "ggufs.json"


@contextlib.contextmanager
def _locked():
    """The registry's lock (flock on a side file), so two processes never lose each other's entry."""
    import fcntl

    path = _registry()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
        return [e for e in data if isinstance(e, dict) and isinstance(e.get("path"), str)]
    except (OSError, ValueError, TypeError):
        return []  # none yet, or damaged: start again rather than fail a load


def _write(path: Path, entries: list[dict]) -> None:
    """Atomically: a temporary file in the same directory, fsynced, renamed over the old one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ggufs-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _in_hf_cache(p: Path) -> bool:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE).resolve() in p.parents
    except Exception:
        return False


def remember_gguf(path: str | os.PathLike) -> None:
    """Record a GGUF loaded by path (its first part, if split) for ``coli list``. Files in the
    Hugging Face cache are listed from there already. Never fails the load that calls it."""
    from coli.weights.gguf import split_files

    try:
        p = split_files(Path(path).resolve())[0]
        if _in_hf_cache(p):
            return
        with _locked() as reg:
            entries = [e for e in _read(reg) if e["path"] != str(p) and Path(e["path"]).is_file()]
            _write(reg, entries + [{"path": str(p), "last_loaded": int(time.time())}])
    except (OSError, ModelLoadError):
        pass


def forget_gguf(path: str | os.PathLike) -> None:
    with _locked() as reg:
        _write(reg, [e for e in _read(reg) if e["path"] != str(path)])


def _gguf_entries() -> list[dict]:
    """The remembered GGUFs whose file still exists (stale entries are dropped from the file)."""
    from coli.weights.gguf import SPLIT

    reg = _registry()
    if not reg.exists():
        return []
    try:
        with _locked():
            entries = _read(reg)
            live = [e for e in entries if Path(e["path"]).is_file()]
            if len(live) != len(entries):
                _write(reg, live)
    except OSError:
        live = [e for e in _read(reg) if Path(e["path"]).is_file()]
    out = []
    for e in sorted(live, key=lambda e: e["path"]):
        p = Path(e["path"])
        m = SPLIT.match(p.name)
        parts = sorted(p.parent.glob(f"{m['stem']}-*-of-{m['count']}.gguf")) if m else [p]
        out.append({"name": str(p), "source": "gguf", "path": str(p), "repo_path": str(p),
                    "size": sum(f.stat().st_size for f in parts if f.is_file())})
    return out


def describe(path: str | os.PathLike, full: bool = False) -> dict:
    """Architecture, parameters (total and active), format of a model path; with ``full``
    also its context, chat template, tool-call and reasoning support and expert layout."""
    from coli.config import ModelConfig
    from coli.weights.converted import is_converted, read_manifest
    from coli.weights.gguf import GGUFModel, GGUFWeights, is_gguf

    path = Path(path)
    out: dict = {"path": str(path)}
    template = None
    if is_gguf(path):
        g = GGUFModel(path)
        cfg = g.config()
        shapes = {n: [int(d) for d in t.shape] for n, t in g.tensors.items()}
        w = GGUFWeights(g)
        out["format"] = "gguf " + "/".join(k for k, _ in g.file_types().most_common(3))
        out["loads_as"] = f"{w.quant} (head {w.head_quant})"
        template = g.get("tokenizer.chat_template")
    else:
        cfg = ModelConfig.from_dir(path)
        if is_converted(path):
            m = read_manifest(path)
            out["format"] = f"coli {m['quant']} (head {m['head_quant']})"
            shapes = {}
            total = sum(_numel(t) for t in m["dense"]["tensors"].values())
            per = sum(p["rows"] * p["cols"] for p in m["experts"]["parts"])
            n_exp = sum(layer["count"] for layer in m["experts"]["layers"].values())
            out["params"], out["_experts"] = total + per * n_exp, per * n_exp
        else:
            from coli.weights.safetensors import Checkpoint

            ck = Checkpoint(path)
            shapes = {n: list(ck.shape(n)) for n in ck.names()}
            dtypes = sorted({ck.dtype(n).lower() for n in ck.names()})
            out["format"] = "safetensors " + "/".join(dtypes)
        tpl = path / "chat_template.jinja"
        if tpl.exists():
            template = tpl.read_text()
        else:
            try:
                template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
            except (OSError, ValueError):
                template = None
    if shapes:
        total = experts = 0
        for name, shape in shapes.items():
            n = 1
            for d in shape:
                n *= d
            total += n
            if ".experts." in name or "_exps" in name:
                experts += n
        out["params"], out["_experts"] = total, experts
    out["arch"] = cfg.model_type
    experts = out.pop("_experts", 0)
    if cfg.num_experts and experts:
        out["active_params"] = out["params"] - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    if full:
        from coli.chat_format import detect

        fmt = detect(cfg.model_type, template if isinstance(template, str) else None)
        out.update(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                   kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
                   context=cfg.max_position_embeddings)
        if cfg.num_experts:
            out["experts"] = {"count": cfg.num_experts, "active": cfg.num_experts_per_tok,
                              "size": cfg.moe_intermediate_size}
        out["chat_format"] = fmt.name
        out["tool_calls"] = "yes" if fmt.tools else "no"
        out["reasoning"] = "yes" if fmt.reasoning else "no"
        if is_gguf(path):
            out["tensor_types"] = dict(GGUFModel(path).file_types())
        out["chat_template"] = template if isinstance(template, str) else None
    return out


def _numel(entry: dict) -> int:
    if entry["kind"] == "matrix":
        return entry["rows"] * entry["cols"]
    n = 1
    for d in entry["shape"]:
        n *= d
    return n


def scan(fit: bool = True) -> list[dict]:
    """Every model coli can see, described; ``fit`` adds whether each fits in memory."""
    from coli.plan import make_plan

    out = []
    for e in _hf_entries() + _converted_entries() + _gguf_entries():
        if fit:
            try:
                e.update({k: v for k, v in describe(e["path"]).items() if k != "path"})
            except Exception as err:  # a half-downloaded or foreign repository: list it, say why
                e["error"] = str(err).splitlines()[0] if str(err) else type(err).__name__
            try:
                e["fits"] = make_plan(e["path"], ctx=512).fits if "error" not in e else None
            except Exception:
                e["fits"] = None
        e.setdefault("params", None)
        out.append(e)
    return out


def find(name: str) -> dict:
    """The entry called ``name`` (a listed name, hub id or path), else the closest suggestion."""
    import difflib

    entries = scan(fit=False)
    p = Path(name).expanduser()
    for e in entries:
        if e["name"] == name or e["path"] == name or (p.exists() and Path(e["path"]) == p.resolve()):
            return e
    if p.exists():
        return {"name": name, "source": "path", "path": str(p), "repo_path": str(p), "size": _dir_size(p)}
    names = [e["name"] for e in entries]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else " (coli list shows what there is)"
    raise ModelLoadError(f"{name}: no such model{hint}")


def remove(entry: dict) -> None:
    """Delete a cached model; a remembered GGUF is only forgotten (the file is the user's)."""
    if entry["source"] == "gguf":
        forget_gguf(entry["path"])
        return
    if entry["source"] == "path":
        raise ModelLoadError(f"{entry['path']}: not in a model cache; coli rm only deletes cached models "
                             "(delete your own files yourself)")
    shutil.rmtree(entry["repo_path"])


# -- running servers ------------------------------------------------------------------------------

def _run_dir() -> Path:
    return coli_home() / "run"


def register_server(info: dict) -> Path:
    """Write this process's runtime file (removed by ``unregister_server``)."""
    d = _run_dir()
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{os.getpid()}.json"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    tmp.rename(f)
    return f


def unregister_server() -> None:
    try:
        (_run_dir() / f"{os.getpid()}.json").unlink()
    except OSError:
        pass


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def running() -> list[dict]:
    out = []
    for f in sorted(_run_dir().glob("*.json")) if _run_dir().is_dir() else []:
        try:
            info = json.loads(f.read_text())
            pid = int(info["pid"])
            os.kill(pid, 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)  # a server that died without cleaning up
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        info["rss"] = _rss(pid)
        out.append(info)
    return out
