"""`checkpoint`, `checkpoint=F`: non-reentrant activation checkpointing of the trained module's repeated
blocks, as `torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)` in its forward does.

The repeated blocks are the largest ModuleList or Sequential under the trained root whose children
are all of one class (two or more); with F, the first ceil(F * n) of them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, List, Optional, Tuple


def repeated_blocks(root: Any) -> Optional[Tuple[str, List[Any]]]:
    """The name and children of the largest ModuleList/Sequential under `root` of two or more children
    of one class (by parameter count, then by number), or None."""
    import torch

    best: Optional[Tuple[Tuple[int, int], str, List[Any]]] = None
    for name, module in root.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        key = (sum(p.numel() for p in module.parameters()), len(children))
        if best is None or key > best[0]:
            best = (key, name, children)
    return None if best is None else (best[1] or type(root).__name__, best[2])


def install(session: Any, value: str) -> None:
    """Checkpoint the first ceil(F * n) repeated blocks of the trained root (F = `value`, 1 when empty)."""
    from torch.utils.checkpoint import checkpoint

    fraction = float(value) if value else 1.0
    session.pending["checkpoint"] = "the script moves no module with parameters to the GPU (.to or .cuda)"

    def wrap(root: Any) -> None:
        found = repeated_blocks(root)
        if found is None:
            session.pending["checkpoint"] = (f"{type(root).__name__} holds no ModuleList or Sequential of two or "
                                             "more modules of one class: no repeated blocks to checkpoint")
            return
        name, blocks = found
        chosen = blocks[:math.ceil(fraction * len(blocks))]
        for block in chosen:
            forward = block.forward

            def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            block.forward = functools.update_wrapper(checkpointed, forward)
        session.pending.pop("checkpoint", None)
        session.notes.append(f"{len(chosen)} of the {len(blocks)} {type(blocks[0]).__name__} blocks of {name} "
                             "checkpointed (torch.utils.checkpoint, use_reentrant=False)")

    session.on_root(wrap)
