"""Build (once, at first use) and load the native extension: the counting CPU allocator in ``_cpu_allocator.cpp``
and the CPU swap store in ``_swap_store.cpp`` (Note: [native swap records]).

The extension is compiled with ``torch.utils.cpp_extension.load`` (g++ and ninja, no network) into
``$TORCH_EXTENSIONS_DIR/<name>`` when that is set, else ``$XDG_CACHE_HOME/adaptive-mem/extensions/<name>``
(``~/.cache/...``); ``<name>`` carries a hash of the source, the torch version and the Python version,
so a later process imports the built module directly and a new torch builds its own. A failed build
raises :class:`RuntimeError` with the compiler's reason; ``_accounting.py`` turns that into one
warning and the dispatch-mode fallback.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["load_extension", "extension_name", "build_directory"]

_SOURCES = [Path(__file__).with_name(name) for name in ("_cpu_allocator.cpp", "_swap_store.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("_swap_worker.h", "_layer_pack.h")]  # included by the sources: part of the build's name
_lock = threading.Lock()
_module: ModuleType | None = None
_error: RuntimeError | None = None


def extension_name() -> str:
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return f"adaptive_mem_cpu_alloc_{digest.hexdigest()[:12]}"


def build_directory(name: str | None = None) -> Path:
    name = name or extension_name()
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / name
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive-mem" / "extensions" / name


def _import_built(name: str, directory: Path) -> ModuleType | None:
    marker = directory / "built.ok"  # written after a complete build: never import a half-linked file
    library = directory / f"{name}.so"
    if not (marker.exists() and library.exists()):
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> str:
    """PATH with the interpreter's bin folder and the ``ninja`` package's binary in front (a venv not
    activated still finds its own ninja)."""
    parts = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package (a dependency)

        parts.append(str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    return os.pathsep.join(parts + [os.environ.get("PATH", "")])


def _build(name: str, directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    old_path = os.environ.get("PATH")
    os.environ["PATH"] = _ninja_on_path()
    try:
        module = load(name=name, sources=[str(source) for source in _SOURCES], build_directory=str(directory),
                      extra_cflags=["-O2", "-std=c++17"], verbose=False)
    finally:
        if old_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old_path
    (directory / "built.ok").write_text(f"{torch.__version__}\n")
    return module


def load_extension() -> ModuleType:
    """The compiled allocator module (built on the first call of the first process); RuntimeError if
    it cannot be built here (no compiler, no ninja, unsupported torch)."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        name = extension_name()
        directory = build_directory(name)
        try:
            _module = _import_built(name, directory) or _build(name, directory)
        except Exception as exc:  # compiler errors come as RuntimeError, a missing ninja as RuntimeError/OSError
            lines = [line for line in str(exc).splitlines() if line.strip()]
            _error = RuntimeError(f"building the C++ CPU allocator in {directory} failed: "
                                  f"{lines[-1] if lines else type(exc).__name__}")
            _error.__cause__ = exc
            raise _error from exc
        return _module
