"""The changes `memdiff whatif --emulate` makes inside the emulator to an unmodified script, one module a
change (the names and values of `memdiff whatif --change`): each is made where the script would make it by
hand, through a few of torch's own entry points patched for the run (never the script's code):

- `Module.to` / `Module.cuda`: the first module with parameters the script moves to the GPU is the
  trained root; `weights=` casts it there (weights.py), `autocast=` wraps its forward (autocast.py),
  `checkpoint` wraps its repeated blocks' forwards (checkpoint.py);
- `Optimizer.__init__`: a model built on the GPU directly (`with torch.device("cuda")`, a
  `device_map`) is never moved; then the trained root is the innermost module that holds the most of
  the first optimizer's parameters, found when that optimizer has been built;
- `Optimizer.__new__`: a torch.optim optimizer the script builds is built as another, or with its
  update in another form (optimizer.py);
- `Optimizer.zero_grad` / `Module.zero_grad`: `set_to_none` forced (zero_grad.py).

`accumulate=K` is not made here: the script's own flag takes it (memdiff.predict.whatif.rerun).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from memdiff.recording.emulate.changes import autocast, checkpoint, optimizer, weights, zero_grad

# The changes made in the emulator, by `--change` name; each module's `install(session, value)`.
INSTALLERS: Dict[str, Callable[["ChangeSession", str], None]] = {
    "checkpoint": checkpoint.install, "weights": weights.install, "autocast": autocast.install,
    "optimizer": optimizer.install, "step": optimizer.install_step, "zero-grad": zero_grad.install}


class ChangeSession:
    """The changes in force in one emulated run: what each did (`notes`), why one did nothing
    (`pending`, until it is made), and what the script itself used (`seen`: its optimizer)."""

    def __init__(self, parts: Sequence[Tuple[str, Optional[str]]]) -> None:
        self.parts = list(parts)
        self.notes: List[str] = []
        self.pending: Dict[str, str] = {}
        self.seen: Dict[str, Any] = {}
        self.stack = contextlib.ExitStack()
        self._on_root: List[Callable[[Any], None]] = []
        self._on_move: List[Callable[[Any], None]] = []
        self._rooted = False  # the trained root was found (and each on_root call made)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name` to `value` for the run, put back when the session closes."""
        had = name in owner.__dict__
        old = owner.__dict__.get(name)
        setattr(owner, name, value)
        self.stack.callback(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def on_root(self, call: Callable[[Any], None]) -> None:
        """Call `call(module)` once, on the trained root (the first module with parameters moved to the GPU)."""
        self._hook_moves()
        self._on_root.append(call)

    def on_move(self, call: Callable[[Any], None]) -> None:
        """Call `call(module)` on every module with parameters the script moves to the GPU, as it returns."""
        self._hook_moves()
        self._on_move.append(call)

    def _hook_moves(self) -> None:
        if self._on_root or self._on_move:
            return
        import torch

        module = torch.nn.Module
        to, cuda = module.to, module.cuda

        def moved(m: Any) -> None:
            if next(m.parameters(), None) is None:
                return
            for call in self._on_move:
                call(m)
            if not self._rooted:
                self._rooted = True
                for call in self._on_root:
                    call(m)

        def patched_to(m: Any, *args: Any, **kwargs: Any) -> Any:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            out = to(m, *args, **kwargs)
            if device is not None and device.type == "cuda":
                moved(m)
            return out

        def patched_cuda(m: Any, device: Any = None) -> Any:
            out = cuda(m, device)
            moved(m)
            return out

        self.patch(module, "to", patched_to)
        self.patch(module, "cuda", patched_cuda)

        base_init = torch.optim.Optimizer.__init__

        def patched_init(opt: Any, *args: Any, **kwargs: Any) -> None:
            base_init(opt, *args, **kwargs)
            if not self._rooted:
                owner = _owner({id(p) for group in opt.param_groups for p in group["params"] if p.is_cuda})
                if owner is not None:
                    moved(owner)

        self.patch(torch.optim.Optimizer, "__init__", patched_init)

    def unmade(self) -> Optional[str]:
        """Why a change asked was not made by the script's end (the first), else None."""
        return next(iter(self.pending.values()), None)


def _owner(params: Set[int]) -> Optional[Any]:
    """The innermost module holding the most of `params` (ids of GPU parameters), or None: the model
    under any wrapper (DDP, a LightningModule) that holds the same parameters."""
    import gc

    import torch

    if not params:
        return None
    held = [(sum(id(p) in params for p in m.parameters()), m) for m in gc.get_objects()
            if isinstance(m, torch.nn.Module)]
    most = max((n for n, _ in held), default=0)
    tops = [m for n, m in held if n == most and n > 0]
    inner = [m for m in tops if not any(o is not m and o in tops for o in m.modules())]
    return inner[0] if inner else None


@contextlib.contextmanager
def applying(parts: Sequence[Tuple[str, Optional[str]]]) -> Iterator[ChangeSession]:
    """The changes `parts` ((name, value) as `memdiff whatif --change` parses them) in force for the block;
    with none, only what the script uses is noted (its optimizer)."""
    session = ChangeSession(parts)
    with session.stack:
        optimizer.watch(session)
        for name, value in parts:
            install = INSTALLERS.get(name)
            if install is None:
                raise ValueError(f"{name} is not a change the emulator makes")
            install(session, value or "")
        yield session
