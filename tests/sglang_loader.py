"""Load SGLang's own KV-event publisher (`sglang.srt.disaggregation.kv_events`) from the
installed wheel without running `sglang/__init__.py`, which imports torch, FlashInfer and the
whole engine.

`sglang.srt` and `sglang.srt.disaggregation` are namespace packages (no `__init__.py`), so only
two packages with heavy `__init__`s stand in the way; each is registered as an empty package
whose `__path__` is the installed directory, and its submodules then import normally:
- `sglang` (its `__init__` loads the public API, hence torch);
- `sglang.srt.utils` (its `__init__` star-imports `utils.common`, which imports torch); the
  publisher only needs `sglang.srt.utils.network` (`NetworkAddress`).
Nothing is stubbed: every module the publisher's code imports is SGLang's real one
(`runtime_context`, `environ`, `arg_groups.*`, `utils.network`), and none of them imports torch
(checked by `load_kv_events`, which refuses to return if torch got loaded anyway).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types

#: The version these interop tests are written against (its native encoding is the map one).
SGLANG_VERSION = "0.5.23"
KV_EVENTS = "sglang.srt.disaggregation.kv_events"

#: Packages whose `__init__` drags in torch; registered empty (their submodules load as usual).
_HEAVY_PACKAGES = ("sglang", "sglang.srt.utils")


class SglangNotInstalled(RuntimeError):
    pass


def _install_hint() -> str:
    return (f"the SGLang wheel is not installed in this interpreter ({sys.executable}); the SGLang "
            f"interop tests drive SGLang's own ZmqEventPublisher, install it without its dependencies "
            f"(torch is not needed): `{sys.executable} -m pip install --no-deps sglang=={SGLANG_VERSION}`; "
            f"its publisher also needs msgspec, pyzmq, pydantic and psutil")


def _sglang_root() -> str:
    installed = sys.modules.get("sglang")
    if installed is not None and getattr(installed, "__path__", None):
        return list(installed.__path__)[0]
    spec = importlib.util.find_spec("sglang")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise SglangNotInstalled(_install_hint())
    return list(spec.submodule_search_locations)[0]


def _register_empty_package(name: str, path: str) -> None:
    if name in sys.modules:
        return
    if not os.path.isdir(path):
        raise SglangNotInstalled(f"{name} not found at {path}: " + _install_hint())
    module = types.ModuleType(name)
    spec = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    spec.submodule_search_locations = [path]
    module.__spec__, module.__path__, module.__package__ = spec, [path], name
    module.__file__ = None
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SglangNotInstalled(_install_hint()) from None


def load_kv_events() -> types.ModuleType:
    """SGLang's `kv_events` module (ZmqEventPublisher, KVEventsConfig, EventPublisherFactory,
    KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared), imported from the wheel.
    Raises SglangNotInstalled with the pip command when the wheel is missing."""
    if KV_EVENTS in sys.modules:
        return sys.modules[KV_EVENTS]
    sglang_version()
    root = _sglang_root()
    torch_before = "torch" in sys.modules
    for name in _HEAVY_PACKAGES:
        _register_empty_package(name, os.path.join(root, *name.split(".")[1:]))
    try:
        module = importlib.import_module(KV_EVENTS)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing == "sglang":
            raise SglangNotInstalled(f"importing {KV_EVENTS} failed ({exc}): " + _install_hint()) from exc
        if missing == "torch":
            raise RuntimeError(f"importing {KV_EVENTS} reached torch ({exc}): the loader needs another "
                               f"empty package in _HEAVY_PACKAGES") from exc
        raise SglangNotInstalled(f"SGLang's publisher needs {missing!r}: {sys.executable} -m pip install "
                                 f"msgspec pyzmq pydantic psutil") from exc
    if not torch_before and "torch" in sys.modules:
        raise RuntimeError(f"importing {KV_EVENTS} pulled in torch: the loader needs another empty package")
    return module
