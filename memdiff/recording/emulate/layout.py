"""The layout a job's script builds, as rank 0 sees it: for `memdiff record --ranks auto` (pick.py).

Which ranks of a job differ only the script knows: a device mesh's dimensions, the groups it makes, a
pipeline's stages are its own. So `--ranks auto` runs rank 0 first with MEMDIFF_RECORD_LAYOUT naming a
file, and this module writes there what the script built, as it builds it:
- every group `new_group` made (device meshes and `new_subgroups` make theirs through it): its ranks,
  its description (`mesh_tp`: a mesh dimension's name) and, for a group rank 0 is in, its name;
- for each group a DTensor is sharded over (FSDP2's parameters, tensor parallelism's weights), whether
  every sharded size divided evenly by the group's size, with the first that did not;
- each pipeline stage built (torch.distributed.pipelining): the stage count and its group's ranks;
- the rank it could not hear from (`recv_object_list`: a pipeline stage's shapes), when it stopped there.
The file is rewritten whole at each change, so what rank 0 built before it failed is still there.
Without the variable nothing here runs.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from memdiff.recording.emulate.on_import import Setting, patched_on_import

LAYOUT = "MEMDIFF_RECORD_LAYOUT"
# The real file functions, taken before the emulator's guards of the user's files replace them: the
# layout file is memdiff's own, in its output folder.
_open, _replace = open, os.replace
_PIPELINE, _DTENSOR = "torch.distributed.pipelining.stage", "torch.distributed.tensor._api"


class Layout:
    """What the script built so far, and the file it is written to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.groups: List[Dict[str, Any]] = []
        self.stages: List[Dict[str, Any]] = []
        self.sharded: Dict[str, Dict[str, Any]] = {}  # by group name: even, and the first uneven size
        self.refused_from: Optional[int] = None
        # (id of a mesh, its dimension): the mesh, held so that its id is never another's, and the group's name
        self._mesh_groups: Dict[Tuple[int, int], Tuple[Any, str]] = {}

    def write(self) -> None:
        """The file, replaced whole: a reader never sees half of it."""
        partial = f"{self.path}.{os.getpid()}.tmp"
        with _open(partial, "w", encoding="utf-8") as f:
            json.dump({"groups": self.groups, "stages": self.stages, "sharded": self.sharded,
                       **({} if self.refused_from is None else {"refused_from": self.refused_from})}, f)
        _replace(partial, self.path)

    def group_made(self, group: Any, ranks: Optional[List[int]], desc: Optional[str]) -> None:
        """`new_group(ranks)` returned `group` (a process group, or torch's marker for a rank not in it)."""
        if ranks is None:  # the world's ranks again: no layout
            return
        name = getattr(group, "group_name", None)
        self.groups.append({"ranks": sorted(int(r) for r in ranks), "desc": desc,
                            **({"name": str(name)} if isinstance(name, str) else {})})
        self.write()

    def stage_built(self, num_stages: int, ranks: List[int]) -> None:
        """A pipeline stage of `num_stages` was built over the group of `ranks`."""
        entry = {"num_stages": int(num_stages), "ranks": sorted(ranks)}
        if entry not in self.stages:
            self.stages.append(entry)
            self.write()

    def spec_made(self, spec: Any) -> None:
        """A DTensor's sharding: for each mesh dimension it is sharded over, whether the size divides."""
        meta = getattr(spec, "tensor_meta", None)
        if meta is None:  # an intermediate of sharding propagation, with no global shape yet
            return
        for dim, placement in enumerate(spec.placements):
            if not placement.is_shard():
                continue
            name = self._group_name(spec.mesh, dim)
            size, parts = int(meta.shape[placement.dim]), int(spec.mesh.size(dim))
            seen = self.sharded.get(name)
            if size % parts == 0 and seen is None:
                self.sharded[name] = {"even": True}
                self.write()
            elif size % parts and (seen is None or seen["even"]):
                self.sharded[name] = {"even": False, "example": f"a tensor of shape {list(meta.shape)} sharded "
                                                               f"on its dim {placement.dim} over {parts} ranks"}
                self.write()

    def _group_name(self, mesh: Any, dim: int) -> str:
        key = (id(mesh), dim)
        if key not in self._mesh_groups:
            self._mesh_groups[key] = (mesh, str(mesh.get_group(dim).group_name))
        return self._mesh_groups[key][1]


_layout: List[Layout] = []


def current() -> Optional[Layout]:
    """The layout being recorded in this process; None when it records none (no MEMDIFF_RECORD_LAYOUT)."""
    return _layout[0] if _layout else None


def refused_from(rank: int) -> bool:
    """Rank 0 stops: it cannot hear from `rank` (p2p.objects_from_sender), which memdiff record then runs
    with it. False where no layout is recorded (not rank 0's first run of --ranks auto, or on --dask)."""
    layout = current()
    if layout is None:
        return False
    layout.refused_from = rank
    layout.write()
    return True


def _stage_init(layout: Layout, real: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        import torch.distributed as dist

        group = self.group if self.group is not None else dist.group.WORLD
        layout.stage_built(self.num_stages, [int(r) for r in dist.get_process_group_ranks(group)])
    __init__.__wrapped__ = real  # type: ignore[attr-defined]
    return __init__


def _dtensor_init(layout: Layout, real: Callable[..., Any]) -> Callable[..., Any]:
    # A DTensor made, not a sharding spec: sharding propagation makes specs of every candidate placement
    # of an op's output (a hidden state sharded on its batch of 1, over tp), which no tensor has.
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        layout.spec_made(self._spec)
    __init__.__wrapped__ = real  # type: ignore[attr-defined]
    return __init__


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """For the block, when MEMDIFF_RECORD_LAYOUT names a file: the script's layout written there as it is
    built (the pipeline stage and the DTensor sharding patched in when torch's modules of them run)."""
    # Taken out of the environment: a process this one starts (a DataLoader worker, a subprocess that
    # imports torch) is no rank 0 and must not write its own, empty, layout over this one's.
    path = os.environ.pop(LAYOUT, None)
    if not path:
        yield
        return
    layout = Layout(path)
    layout.write()  # a script that builds nothing still says so

    def patch(name: str, module: Any) -> Setting:
        owner, attribute, wrap = ((module._PipelineStageBase, "__init__", _stage_init) if name == _PIPELINE
                                  else (module.DTensor, "__init__", _dtensor_init))
        return owner, attribute, wrap(layout, owner.__dict__[attribute])
    _layout[:] = [layout]
    try:
        with patched_on_import((_PIPELINE, _DTENSOR), patch):
            yield
    finally:
        _layout.clear()
