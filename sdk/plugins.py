"""Plugin loading: entry points of group `megakernel_sdk.models`, lazily and once.

- Nothing is imported until the first call that needs the registry (`import sdk` loads no plugin).
- `MEGAKERNEL_SDK_PLUGINS`, if set, is a comma-separated allow-list of entry-point names; the
  others are not loaded (an empty value loads none).
- A plugin that fails to import or raises in a hook is reported (a warning, and listed by
  `plugin_errors()` and `megakernel models`) and skipped; it never breaks the others.
- Plugins must not touch CUDA at import; the SDK itself never does.
"""
from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import replace
from importlib import metadata

import pluggy

from . import hookspecs
from .errors import PluginError, UnknownModelError
from .registry import ModelEntry

ENTRY_POINT_GROUP = "megakernel_sdk.models"
ALLOW_ENV = "MEGAKERNEL_SDK_PLUGINS"
DISTRIBUTION = "megakernel-sdk"
# Used only when the SDK runs from a source tree that was never pip-installed (no entry points
# exist then); an installed SDK loads its in-tree models through its own entry points.
IN_TREE_FALLBACK = {"kimi_k3": "models.kimi_k3", "deepseek_v41_flash": "models.deepseek_v41_flash",
                    "glm_53": "models.glm_53"}


class _State:
    def __init__(self):
        self.pm: pluggy.PluginManager | None = None
        self.models: dict[str, ModelEntry] = {}
        self.blocks: list = []
        self.backends: dict[str, object] = {}
        self.errors: list[str] = []
        self.loaded: list[str] = []


_lock = threading.Lock()
_state: _State | None = None


def _entry_points():
    eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    try:
        metadata.distribution(DISTRIBUTION)
        installed = True
    except metadata.PackageNotFoundError:
        installed = False
    if not installed:
        have = {ep.name for ep in eps}
        eps += [metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)
                for name, value in IN_TREE_FALLBACK.items() if name not in have]
    return eps


def _allowed(name: str) -> bool:
    allow = os.environ.get(ALLOW_ENV)
    if allow is None:
        return True
    return name in {n.strip() for n in allow.split(",") if n.strip()}


def _report(state: _State, message: str) -> None:
    state.errors.append(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _load() -> _State:
    state = _State()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    from . import builtin_plugin  # the SDK's own blocks and backends
    pm.register(builtin_plugin, name="sdk")
    seen = set()
    for ep in _entry_points():
        if ep.name in seen or not _allowed(ep.name):
            continue
        seen.add(ep.name)
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
            state.loaded.append(ep.name)
        except Exception as exc:  # a broken plugin is reported, never fatal
            _report(state, f"plugin {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}")
    state.pm = pm
    _collect(state, pm)
    return state


def _collect(state: _State, pm: pluggy.PluginManager) -> None:
    for impl in pm.hook.register_models.get_hookimpls():
        plugin_name = impl.plugin_name

        def register(entry, _plugin=plugin_name):
            if not isinstance(entry, ModelEntry):
                raise PluginError(f"register_models expects a ModelEntry, got {type(entry).__name__}")
            if entry.name in state.models:
                _report(state, f"plugin {_plugin!r}: model {entry.name!r} already registered by "
                               f"{state.models[entry.name].plugin!r}; skipped")
                return
            state.models[entry.name] = replace(entry, plugin=_plugin)

        _call(state, impl, register)
    for impl in pm.hook.register_blocks.get_hookimpls():
        _call(state, impl, state.blocks.append)
    for impl in pm.hook.register_backends.get_hookimpls():
        _call(state, impl, lambda name, factory: state.backends.setdefault(name, factory))


def _call(state: _State, impl, register) -> None:
    try:
        impl.function(register=register)
    except Exception as exc:
        _report(state, f"plugin {impl.plugin_name!r}: {impl.function.__name__} failed: "
                       f"{type(exc).__name__}: {exc}")


def state() -> _State:
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


def reset() -> None:
    """Forget everything loaded (tests; after installing a plugin package)."""
    global _state
    with _lock:
        _state = None
        importlib.invalidate_caches()


def models() -> dict[str, ModelEntry]:
    return dict(state().models)


def get_model(name: str) -> ModelEntry:
    registered = state().models
    if name not in registered:
        names = ", ".join(sorted(registered)) or "(none)"
        raise UnknownModelError(f"unknown model {name!r}; registered models: {names}")
    return registered[name]


def blocks() -> list:
    return list(state().blocks)


def backends() -> dict:
    return dict(state().backends)


def plugin_errors() -> list[str]:
    return list(state().errors)


def loaded_plugins() -> list[str]:
    return list(state().loaded)
