"""All the SDK's hook specifications, in one module.

A plugin is a module (or object) with functions marked `@sdk.hookimpl`, published under the
entry-point group `megakernel_sdk.models`. The in-tree models register through the same entry
points as third-party ones. Every hook here is documented in `docs/plugins.md`; a test checks that
the docs list each hook with its signature.
"""
import pluggy

PROJECT = "megakernel_sdk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_models(register):
    """Register model packages.

    :param register: callable taking one `sdk.registry.ModelEntry`; call it once per model the
        plugin provides. Registering a name that is already taken is reported and skipped.
    """


@hookspec
def register_blocks(register):
    """Register device blocks (CuTe DSL building blocks of the megakernel).

    :param register: callable taking one block class (a subclass of `sdk.blocks.base.Block`).
        Opcodes are assigned by the registry in registration order, never by hand.
    """


@hookspec
def register_backends(register):
    """Register execution backends for `build_megakernel(..., backend=NAME)`.

    :param register: callable taking `(name, factory)`, where `factory(entry, spec, **options)`
        returns the runnable object (`decode`, `generate`, `load_hf_state_dict`).
    """
