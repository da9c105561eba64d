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


def _megakernel(entry, spec, *, device, dtype, tp, ep, rank, max_seq_len, max_batch, **options):
    """The whole-model megakernel (one launch a decode step): DeepSeek-V4.1 for now."""
    from .errors import UnsupportedConfigError
    if entry.name != "deepseek_v41_flash":
        raise UnsupportedConfigError(f"the megakernel backend runs deepseek_v41_flash (configs small / small_v41: "
                                     f"the device blocks' shapes); "
                                     f"not {entry.name!r} yet - its sublayer programs are in sdk/megakernel")
    if tp != 1 or ep != 1:
        raise UnsupportedConfigError("the megakernel backend runs the model's program on one GPU: tp=1, ep=1")
    from .megakernel.dsv4_model import DSV4MegakernelModel
    return DSV4MegakernelModel(entry, spec, device=device, dtype=dtype, max_seq_len=max_seq_len,
                               max_batch=max_batch, **options)


@hookimpl
def register_backends(register):
    register("reference", _reference)
    register("megakernel", _megakernel)


@hookimpl
def register_blocks(register):
    from .blocks import builtin_blocks   # torch-only modules: no CuTe DSL import here
    for block_class in builtin_blocks():
        register(block_class)
