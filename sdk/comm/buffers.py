"""Symmetric buffers: every rank owns one region of the same size and layout; a rank reaches
its peers' regions through pointers valid on its own device.

    layout = SymmetricLayout()
    layout.add("ar.data.c0", nbytes, kind="data"); layout.add("ar0.flags", nbytes, kind="flags")
    bufs = VirtualRanks(4, layout, device="cuda")            # or TorchSymmetricMemory(layout, group)
    t = bufs.view(owner=2, viewer=0, name="ar0.flags", shape=(T, 4), dtype=torch.int32)

`view(owner, viewer, ...)` is a tensor on the viewer's device aliasing the owner's memory; its
`data_ptr()` is what goes into the viewer's megakernel operand table.

Implementations:
- `VirtualRanks(n, layout, device)`: n plain allocations on one device (CUDA or CPU). The
  viewer does not matter: every rank's region is directly addressable. Peer stores land in
  local HBM, so this tests the protocol and measures instruction overhead, not NVLink.
- `TorchSymmetricMemory(layout, group=None)`: one process per GPU (this rank only);
  `torch.distributed._symmetric_memory.empty` + `rendezvous` exchange the peers' mappings
  (CUDA IPC / driver VMM under the hood); peer views come from `get_buffer(peer, ...)`.
  Written for any group size; imports torch.distributed when constructed, never at import.
  No multicast objects are requested (NVLink multicast is disabled on our machines).

Flags must start at zero and are then never reset by the kernels (epochs); `zero_flags()`
zeroes them on the ranks this process owns (after an error, or to restart epochs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 256          # bytes: every region starts on a 256-byte boundary (16-byte vectors, L2 sectors)


@dataclass(frozen=True)
class Region:
    name: str
    offset: int      # bytes from the start of the rank's symmetric buffer
    nbytes: int
    kind: str        # "data" | "flags"


class SymmetricLayout:
    """Named regions of the per-rank symmetric buffer; identical on every rank by construction
    (the same sequence of `add` calls)."""

    def __init__(self):
        self.regions: dict[str, Region] = {}
        self.nbytes = 0

    def add(self, name: str, nbytes: int, kind: str = "data") -> Region:
        if name in self.regions:
            r = self.regions[name]
            if nbytes > r.nbytes:
                raise ValueError(f"symmetric region {name!r} exists with {r.nbytes} B < {nbytes} B")
            return r
        if kind not in ("data", "flags"):
            raise ValueError(f"region kind {kind!r} (data, flags)")
        r = Region(name, self.nbytes, int(nbytes), kind)
        self.regions[name] = r
        self.nbytes += -(-int(nbytes) // ALIGN) * ALIGN
        return r

    def grow(self, name: str, nbytes: int, kind: str = "data") -> None:
        """Make region `name` at least nbytes (only before any region follows it, or new)."""
        if name not in self.regions:
            self.add(name, nbytes, kind)
            return
        r = self.regions[name]
        if nbytes <= r.nbytes:
            return
        if r.offset + -(-r.nbytes // ALIGN) * ALIGN != self.nbytes:
            raise ValueError(f"region {name!r} cannot grow: other regions follow it")
        self.regions[name] = Region(name, r.offset, int(nbytes), r.kind)
        self.nbytes = r.offset + -(-int(nbytes) // ALIGN) * ALIGN


def _view(flat: torch.Tensor, region: Region, shape, dtype, offset_elems: int = 0) -> torch.Tensor:
    esize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    start = region.offset + offset_elems * esize
    if offset_elems * esize + n * esize > region.nbytes:
        raise ValueError(f"view {list(shape)} {dtype} at element {offset_elems} overruns region "
                         f"{region.name!r} ({region.nbytes} B)")
    return flat[start:start + n * esize].view(dtype).view(*shape)


class SymmetricBuffers:
    """Interface: `world_size`, `local_ranks` (the ranks this process drives), `view()`,
    `zero_flags()`."""

    layout: SymmetricLayout
    world_size: int
    local_ranks: list[int]

    def _flat(self, owner: int, viewer: int) -> torch.Tensor:
        """The owner's whole region as uint8, addressable from the viewer's device."""
        raise NotImplementedError

    def view(self, owner: int, viewer: int, name: str, shape, dtype, offset_elems: int = 0) -> torch.Tensor:
        if viewer not in self.local_ranks:
            raise ValueError(f"rank {viewer} is not driven by this process (local ranks {self.local_ranks})")
        if not 0 <= owner < self.world_size:
            raise ValueError(f"rank {owner} outside 0..{self.world_size - 1}")
        return _view(self._flat(owner, viewer), self.layout.regions[name], shape, dtype, offset_elems)

    def zero_flags(self) -> None:
        for r in self.local_ranks:
            flat = self._flat(r, r)
            for reg in self.layout.regions.values():
                if reg.kind == "flags":
                    flat[reg.offset:reg.offset + reg.nbytes].zero_()


class VirtualRanks(SymmetricBuffers):
    """N ranks in one process on one device: N plain allocations (zeroed)."""

    def __init__(self, n: int, layout: SymmetricLayout, device="cuda"):
        self.layout = layout
        self.world_size = n
        self.local_ranks = list(range(n))
        self.device = torch.device(device)
        self.flats = [torch.zeros(max(layout.nbytes, ALIGN), dtype=torch.uint8, device=self.device)
                      for _ in range(n)]

    def _flat(self, owner, viewer):
        return self.flats[owner]


class TorchSymmetricMemory(SymmetricBuffers):
    """This process's rank of a torch.distributed group (one GPU per process), with its peers'
    regions mapped through torch symmetric memory. Call after `torch.distributed` is initialised
    and `torch.cuda.set_device(local GPU)`; every rank must construct it with the same layout
    (it is a collective: rendezvous)."""

    def __init__(self, layout: SymmetricLayout, group=None, device=None):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        self.layout = layout
        group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_ranks = [self.rank]
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        nbytes = max(layout.nbytes, ALIGN)
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.local.zero_()
        name = group.group_name if hasattr(group, "group_name") else group
        self.handle = symm_mem.rendezvous(self.local, name)
        self._peers = [self.local if p == self.rank else self.handle.get_buffer(p, (nbytes,), torch.uint8)
                       for p in range(self.world_size)]
        torch.cuda.synchronize(self.device)
        dist.barrier(group)            # every rank zeroed its flags before anyone can raise one

    def _flat(self, owner, viewer):
        return self._peers[owner]
