"""On-disk cache of NVRTC builds (sandbox/loader.py builds, this module stores and finds them).

One entry per build: `<key>.cubin` (the CUBIN, loadable as is with cupy.RawModule(path=...)) and
`<key>.json` (name expression -> lowered (mangled) name, the NVRTC / ptxas log with its register,
spill and shared-memory report, the architecture, the NVRTC version and the CUBIN's sha256).

- Key: sha256 of the whole inlined source text, the NVRTC options, the sorted name expressions,
  the target architecture and the NVRTC version (plus FORMAT, this layout's version). The CUDA
  headers outside kernels_cu/ are named by their include path only: after replacing them in place
  without a new NVRTC version, clear the cache (delete the folder).
- Location: $SANDBOX_CACHE_DIR, else $XDG_CACHE_HOME/fa-sandbox, else ~/.cache/fa-sandbox.
  SANDBOX_CACHE_DIR=off (or 0) disables the cache, and with it the loader's NVRTC-to-CUBIN run-time
  path: CuPy then compiles through its own NVRTC as before (the fallback).
- Writes are atomic (a temporary file in the same folder, then os.replace), the JSON after the
  CUBIN: parallel processes and pytest-xdist workers may build and store the same entry at once.
- A read checks the JSON, the key, the names and the CUBIN's size and sha256: a corrupt, partial or
  foreign entry reads as a miss, and the next build overwrites it.
- A build of a missing entry holds an advisory lock on `locks/<key>.lock` (flock, POSIX): a second
  process that wants the same entry meanwhile waits and then reads it instead of compiling it again
  (pytest-xdist workers each running the compile report).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:              # not POSIX: builds of one entry in two processes both compile
    fcntl = None

FORMAT = 1
DISABLED = ("off", "0")


def cache_dir() -> Path | None:
    """The cache folder, or None when SANDBOX_CACHE_DIR is "off" or "0" (read on every call)."""
    value = os.environ.get("SANDBOX_CACHE_DIR", "").strip()
    if value.lower() in DISABLED:
        return None
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fa-sandbox"


def enabled() -> bool:
    """Not switched off by SANDBOX_CACHE_DIR (cheap: the loader asks on every kernel lookup)."""
    return os.environ.get("SANDBOX_CACHE_DIR", "").strip().lower() not in DISABLED


@dataclass(frozen=True)
class Build:
    """One NVRTC build: the CUBIN, name expression -> lowered name, the compile log."""

    cubin: bytes = field(repr=False)
    lowered: dict
    log: str = field(repr=False)
    arch: str = ""
    nvrtc: str = ""
    key: str = ""
    path: Path | None = None      # the CUBIN file in the cache, where stored
    cached: bool = False          # read from the cache (no NVRTC run in this process)


def key(source_text: str, options, names, arch: str, nvrtc_version: str) -> str:
    """sha256 hex digest of everything that decides a build's output."""
    payload = json.dumps({"format": FORMAT, "source": source_text, "options": list(options),
                          "names": sorted(names), "arch": arch, "nvrtc": nvrtc_version},
                         sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def _paths(folder: Path, k: str) -> tuple[Path, Path]:
    return folder / f"{k}.cubin", folder / f"{k}.json"


def load(k: str, names) -> Build | None:
    """The stored build for key `k`, or None (disabled, absent, corrupt, partial, or not for `names`)."""
    folder = cache_dir()
    if folder is None:
        return None
    cubin_path, meta_path = _paths(folder, k)
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
        if (meta.get("format") != FORMAT or meta.get("key") != k or len(cubin) != meta.get("cubin_size")
                or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256")):
            return None
        lowered = {str(n): str(low) for n, low in meta["lowered"].items()}
        if set(lowered) != set(names) or not all(lowered.values()):
            return None
        return Build(cubin, lowered, str(meta.get("log", "")), str(meta["arch"]), str(meta["nvrtc"]), k,
                     cubin_path, cached=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


_warned = False


def store(build: Build) -> Build:
    """Write `build` under its key; returns it with `path` set (unchanged when disabled or when the
    folder cannot be written: a warning, once per process, and the build goes on uncached)."""
    global _warned
    folder = cache_dir()
    if folder is None:
        return build
    cubin_path, meta_path = _paths(folder, build.key)
    meta = {"format": FORMAT, "key": build.key, "arch": build.arch, "nvrtc": build.nvrtc,
            "lowered": build.lowered, "log": build.log, "cubin_size": len(build.cubin),
            "cubin_sha256": hashlib.sha256(build.cubin).hexdigest()}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(cubin_path, build.cubin)
        atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    except OSError as e:
        if not _warned:
            _warned = True
            warnings.warn(f"kernel cache {folder} not written ({e}); builds go on uncached "
                          "(SANDBOX_CACHE_DIR picks another folder, =off disables it)", RuntimeWarning)
        return build
    return Build(build.cubin, build.lowered, build.log, build.arch, build.nvrtc, build.key, cubin_path, build.cached)


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then os.replace: readers see the old file or the new
    one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)          # mkstemp's 0600 would keep a shared cache folder private
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextlib.contextmanager
def building(k: str):
    """Hold the build lock of key `k` (no-op when disabled, without flock, or where the lock file
    cannot be made); released when the block ends or the process dies."""
    folder = cache_dir()
    handle = None
    if folder is not None and fcntl is not None:
        try:
            (folder / "locks").mkdir(parents=True, exist_ok=True)
            handle = open(folder / "locks" / f"{k}.lock", "ab")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError:
            if handle is not None:
                handle.close()
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            handle.close()
