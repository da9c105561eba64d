"""The SDK's own plugin: its backends (and, once they exist, its blocks)."""
from .hookspecs import hookimpl


def _reference(entry, spec, *, device, dtype, tp, ep, rank, max_seq_len, max_batch, **options):
    from .errors import UnsupportedConfigError
    from .reference.model import ReferenceModel
    if tp != 1 or ep != 1:
        raise UnsupportedConfigError("the reference backend runs the whole model on one device: tp=1, ep=1")
    if options:
        raise UnsupportedConfigError(f"the reference backend takes no options {sorted(options)}")
    return ReferenceModel(entry, spec, device=device, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch)


@hookimpl
def register_backends(register):
    register("reference", _reference)


@hookimpl
def register_blocks(register):
    from .blocks import builtin_blocks   # torch-only modules: no CuTe DSL import here
    for block_class in builtin_blocks():
        register(block_class)
