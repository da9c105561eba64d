"""`no_host_syncs()`: a context in which every torch call that makes the host wait for the device
- reading a value (item, tolist, int(), float(), bool()), or a result whose shape depends on the
data (nonzero, unique, masked_select, where(cond), indexing with a boolean mask) - raises
HostSyncError naming it. On the CPU it finds what would break a CUDA graph capture, without a GPU."""
import contextlib

import torch


class HostSyncError(AssertionError):
    pass


def _bool_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def no_host_syncs():
    patched = []

    def patch(owner, name, check=None):
        orig = getattr(owner, name)

        def guard(*args, **kwargs):
            if check is None or check(*args, **kwargs):
                raise HostSyncError(f"host sync: {getattr(owner, '__name__', owner)}.{name}")
            return orig(*args, **kwargs)
        setattr(owner, name, guard)
        patched.append((owner, name, orig))

    try:
        for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "unique",
                     "masked_select"):
            patch(torch.Tensor, name)
        for name in ("nonzero", "unique", "masked_select", "argwhere"):
            patch(torch, name)
        patch(torch, "where", lambda *a, **k: len(a) + len(k) == 1)
        patch(torch.Tensor, "__getitem__", lambda self, idx: _bool_index(idx))
        patch(torch.Tensor, "__setitem__", lambda self, idx, value: _bool_index(idx))
        yield
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)
