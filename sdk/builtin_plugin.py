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


# the whole-model programs: model -> (module, backend class); tensor parallel (tp > 1): TP_MODELS
MEGAKERNEL_MODELS = {"deepseek_v41_flash": ("mhc_model", "MHCMegakernelModel"),
                     "glm_53": ("mhc_model", "MHCMegakernelModel"),
                     "kimi_k3": ("plain_model", "PlainMegakernelModel")}
TP_MODELS = {"kimi_k3": ("tp_model", "TPMegakernelModel"), "glm_53": ("tp_model", "TPMHCMegakernelModel"),
             "deepseek_v41_flash": ("tp_model", "TPMHCMegakernelModel")}


def _megakernel(entry, spec, *, device, dtype, tp, ep, rank, max_seq_len, max_batch, **options):
    """The whole-model megakernel (one launch a decode step) of each model in MEGAKERNEL_MODELS."""
    import importlib

    from .errors import UnsupportedConfigError
    if entry.name not in MEGAKERNEL_MODELS:
        raise UnsupportedConfigError(f"the megakernel backend runs {', '.join(MEGAKERNEL_MODELS)} (configs small / "
                                     f"small_v41: the device blocks' shapes), not {entry.name!r}")
    if ep != 1 or rank != 0 or (tp != 1 and entry.name not in TP_MODELS):
        raise UnsupportedConfigError(
            f"the megakernel backend runs {entry.name}'s program on one GPU (tp=1, ep=1)"
            + (f", or tensor parallel (tp=N) for {', '.join(TP_MODELS)} with every rank driven from this "
               "process (rank=0)" if TP_MODELS else ""))
    module, cls = (TP_MODELS if tp != 1 else MEGAKERNEL_MODELS)[entry.name]
    model = getattr(importlib.import_module(f".megakernel.{module}", __package__), cls)
    if tp != 1:
        options["ranks"] = tp
    return model(entry, spec, device=device, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch, **options)


@hookimpl
def register_backends(register):
    register("reference", _reference)
    register("megakernel", _megakernel)


@hookimpl
def register_blocks(register):
    from .blocks import builtin_blocks   # torch-only modules: no CuTe DSL import here
    for block_class in builtin_blocks():
        register(block_class)
