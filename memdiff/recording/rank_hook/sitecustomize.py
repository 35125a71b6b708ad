"""Record every process of a launched job: put on the children's PYTHONPATH by `memdiff record -o DIR/`.

Python imports `sitecustomize` at start-up in every process, so each rank a launcher starts
(torchrun, accelerate, deepspeed) runs this without any change to the user's code, the way
coverage.py measures subprocesses. It does nothing unless MEMDIFF_RECORD_DIR is set, and never
imports torch itself: when torch's module has run, recording starts, once (CUDA: at CUDA's lazy
initialization, after the script has picked its device; else the profiler). The hook is a finder
on sys.meta_path that stays there until then: `importlib.util.find_spec("torch")` (transformers'
`is_torch_available`), `importlib.import_module`, lazy loaders and imports from a thread all ask it,
and only the module's execution starts the recording. torch imported before this file ran (by a
`.pth` file) starts it here.

Where the snapshot is written, and when:
- The process a launcher started as rank R (it has RANK in its environment first) writes
  DIR/rank{R}.pickle. A process it starts in turn inherits RANK but not the rank: it writes
  DIR/pid{PID}.pickle, as does any process without a RANK. A forked copy writes nothing.
- Recording stops and the file is written at the first of: `destroy_process_group()` of the
  default group (before torch.distributed tears its threads down, which must never happen
  while the profiler still runs), SIGTERM (a launcher ending the other ranks after one failed:
  that is the run people debug), a CUDA out-of-memory error, and the process's exit.
- Every process reports what became of its recording in a hidden status file, DIR/.rank{R}.status
  for a rank and DIR/.pid{PID}.status for any other process: it started (before torch), it never
  imported torch, it started Python processes without this hook (an environment without its
  PYTHONPATH), then written, failed and why, or nothing recorded. From them `memdiff record` tells
  which ranks are missing and why a run wrote nothing. A process that allocated nothing writes no
  snapshot.

Any other sitecustomize on the path still runs, and a failure here prints one line and lets the
program go on.
"""

import _thread
import atexit
import importlib.machinery
import importlib.util
import itertools
import os
import signal
import stat
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The pid of the process that is rank RANK, set by that process for everything it starts.
OWNER = "MEMDIFF_RECORD_RANK_PID"
# The GPU to emulate (`memdiff record --emulate GPU -o DIR/`): every process runs on it, with no GPU.
EMULATE = "MEMDIFF_RECORD_EMULATE"
# A rank run as a Dask task: the read end of a pipe whose write end only its worker holds (dask_ranks.py).
LEASE_FD = "MEMDIFF_RECORD_LEASE_FD"
# Lightning's launcher that re-runs the script per rank, in each of its packages (launch_lightning.SCRIPTS):
# patched as it is imported, so that its ranks stop as torchrun's do, writing their snapshots (lightning_stop.py).
LIGHTNING_LAUNCHERS = tuple(f"{package}.strategies.launchers.subprocess_script" for package in (
    "lightning.fabric", "lightning.pytorch", "lightning_fabric", "pytorch_lightning"))


def _say(message):
    print(f"memdiff: {message}", file=sys.stderr, flush=True)


def _rank():
    """This process's rank when it is the rank itself (not a child that inherited RANK), else None."""
    rank = os.environ.get("RANK", "")
    if _digits(rank) and os.environ.get(OWNER) == str(os.getpid()):
        return int(rank)
    return None


def _digits(text):
    """Whether `text` is ASCII digits (memdiff.numbers.DIGITS; not imported here, where every process of the
    job starts): str.isdigit() takes "²", which int() refuses, and int() reads "٢" as 2."""
    return text.isascii() and text.isdigit()


def _world_size():
    size = os.environ.get("WORLD_SIZE", "")
    return int(size) if _digits(size) else None


def _claim(folder, rank):
    """The folder this process writes rank `rank`'s files in: DIR, or DIR/job2, DIR/job3, ... when a job
    run earlier by the same command already had a rank `rank` (a script that trains, then evaluates,
    each under torchrun): its snapshot is never written over. A claim is a file made exclusively, so
    two processes never both take one; `memdiff record` removes the claims when the command ends."""
    for number in itertools.count(1):
        here = folder if number == 1 else os.path.join(folder, f"job{number}")
        try:
            os.makedirs(here, exist_ok=True)
            os.close(os.open(os.path.join(here, f".rank{rank}.claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return here
        except FileExistsError:
            continue
        except OSError:  # the folder went away or is read only: the write says so later
            return here


class _Status:
    """This process's status file: what `memdiff record` is told of it, rewritten whole at each change
    (atomically: a process killed mid-write leaves the previous one)."""

    def __init__(self, folder):
        self.rank = _rank()
        self.folder = _claim(folder, self.rank) if self.rank is not None else folder
        name = f".rank{self.rank}.status" if self.rank is not None else f".pid{os.getpid()}.status"
        self.path = os.path.join(self.folder, name)
        self.facts = {"rank": self.rank, "world_size": _world_size(), "pid": os.getpid(),
                      "command": " ".join(sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv)[:300]}
        self.started_without_hook = []  # commands this process started in an environment without the hook
        self.died = None  # the exception (or exit status) that ended the process
        self.state, self.last = None, {}
        self.writes = itertools.count()

    def write(self, state, **facts):
        """Say `state` (and `facts`) for this process; a forked copy says nothing."""
        if os.getpid() != self.facts["pid"]:
            return
        import json

        self.state, self.last = state, facts
        document = {**self.facts, "state": state, **facts}
        if self.started_without_hook:
            document["started_without_hook"] = self.started_without_hook[:5]
        if _refused:
            document["refused"] = _refused[0]
        if self.died:
            document["died"] = self.died
        running = os.environ.get("MEMDIFF_RECORD_RANKS")  # launch.RANKS: the job's ranks that run, when some do
        if running:
            document["running"] = running
            if os.environ.get("MEMDIFF_RECORD_FIRST_NODE"):  # launch.FIRST_NODE: its launcher's node's ranks
                document["first_node"] = True
        if _EMULATOR is not None and _EMULATOR.out_of_memory:  # even one the script caught (`memdiff fit`)
            document["out_of_memory"] = _EMULATOR.out_of_memory[0][:500]
        # A name of its own per write: another thread, or a signal handler on this one, may be writing too.
        temporary = f"{self.path}.{os.getpid()}.{next(self.writes)}.tmp"
        try:
            with open(temporary, "w") as f:
                f.write(json.dumps(document))
            os.replace(temporary, self.path)
        except OSError as exc:  # the folder went away, or is full: the program goes on
            if os.path.isdir(self.folder):  # gone: the run is over (a helper process that outlived it)
                _say(f"could not write {self.path}: {exc}")


    def became(self, rank, world_size):
        """This process is `rank` of `world_size`, as its launcher's process group says (Lightning's and
        torch.multiprocessing's ranks have no RANK in their environment): its status is the rank's."""
        if self.rank is not None or os.getpid() != self.facts["pid"]:
            return
        old = self.path
        self.rank = rank
        self.folder = _claim(self.folder, rank)
        self.facts.update(rank=rank, world_size=world_size)
        self.path = os.path.join(self.folder, f".rank{rank}.status")
        self.write(self.state, **self.last)
        try:
            os.unlink(old)
        except OSError:
            pass

    def ended(self, why):
        """The process is ending of `why` (its exception's line, or a failing exit status)."""
        if self.died is None and os.getpid() == self.facts["pid"]:
            self.died = why[:500]
            self.write(self.state, **self.last)


class _Recording:
    """One process's recording: started once, stopped and written once, at the first stop point."""

    def __init__(self, torch, capture, status):
        self.torch, self.capture, self._status = torch, capture, status
        self.pid = os.getpid()
        self.finish = None
        self.steps = 0  # optimizer steps run, counted with MEMDIFF_RECORD_STEPS
        self.unreached = None  # why a window of steps recorded nothing
        self.done = False
        self.writing = False  # a SIGTERM (SIGHUP) arriving now waits for the write, then ends the process
        self.terminated = None  # the signal that came during the write

    @property
    def target(self):
        """The snapshot's path: the rank's file once the process knows its rank, else its pid's."""
        rank = self._status.rank
        # the status's folder: a rank of a second job of the command writes in DIR/job2 (_claim)
        return os.path.join(self._status.folder, f"rank{rank}.pickle" if rank is not None else f"pid{self.pid}.pickle")

    def status(self, state, **facts):
        """Tell `memdiff record` what became of this process's recording."""
        self._status.write(state, **facts)

    def write(self, why):
        """Stop recording and write the snapshot; later calls do nothing."""
        if self.done or os.getpid() != self.pid:  # written already, or a forked copy
            return
        self.done = True
        finish, self.finish = self.finish, None
        if finish is None:  # on a GPU machine, a process that never initialized CUDA; a window not reached
            if self.unreached is not None:
                self.status("nothing recorded", at=why, error=self.unreached)
            else:
                self.status("nothing recorded", at=why)
            return
        self.writing = True
        interrupted = False
        try:
            # A Ctrl-C now (the terminal's and the launcher's, one after the other) must not cut the
            # write short: held, then passed on where the program goes on (at exit it ends anyway).
            with self.capture.sigint_held() as held:
                self._write(finish, why)
            interrupted = bool(held)
        finally:
            self.writing = False
            if self.terminated is not None:  # SIGTERM came during the write: die of it now, as the process would have
                _die_of(self.terminated)
        if interrupted and why != "exit":
            signal.raise_signal(signal.SIGINT)

    def _write(self, finish, why):
        try:
            snapshot = finish()
            if self.capture.recorded_nothing(snapshot):
                self.status("nothing recorded", at=why)
                return
            self.capture.dump(snapshot, self.target)
            self.status("written", at=why, file=os.path.basename(self.target))
        except Exception as exc:  # the program goes on (or has ended): say why the rank has no file
            reason = f"{type(exc).__name__}: {exc}"[:500]
            _say(f"could not write {self.target}: {reason}")
            try:
                self.status("failed", at=why, error=reason)
            except Exception:
                pass

    def start(self):
        torch, capture = self.torch, self.capture
        # Before recording starts: a SIGTERM (or SIGHUP) from then on writes what was recorded.
        self._write_on_sigterm()
        self.status("recording")
        steps = os.environ.get("MEMDIFF_RECORD_STEPS")
        if steps:
            self._count_steps(capture.parse_steps(steps))
        elif capture.has_cuda(torch):
            # At CUDA's lazy initialization, not now: starting it here would make a context on
            # device 0 in every rank before the script picks its own.
            torch.cuda._lazy_call(self._start_cuda)
        else:
            self.finish = capture.start_cpu(torch)
        self._stop_before_teardown()
        self._rank_from_process_group()
        atexit.register(self.write, "exit")

    def _count_steps(self, window):
        """Record optimizer steps window.start to window.stop only: start once `start` steps have run
        (counted by torch's global optimizer step hook), write once `stop` have."""
        self.unreached = f"the window {window} was not reached: 0 optimizer steps ran"
        started = []  # the step count recording started at

        def on_step(count):
            if self.done or os.getpid() != self.pid:
                return
            if not started and window.start <= count < window.stop:
                started.append(count)
                if self.capture.has_cuda(self.torch) and count == 0:
                    # before the first step: at CUDA's initialization, as without a window
                    self.torch.cuda._lazy_call(self._start_cuda)
                elif self.capture.has_cuda(self.torch):
                    self._start_cuda()
                else:
                    self.finish = self.capture.start_cpu(self.torch)
            elif self.finish is not None and count >= window.stop:
                self.write(f"steps {window}")
            if not started:
                self.unreached = f"the window {window} was not reached: {count} optimizer step(s) ran"

        def after_step(optimizer, args, kwargs):
            self.steps += 1
            try:
                on_step(self.steps)
            except Exception as exc:  # the training goes on without a recording
                _say(f"not recording process {self.pid}: {type(exc).__name__}: {exc}")
                self.done = True
                self.status("failed", at=f"step {self.steps}", error=f"{type(exc).__name__}: {exc}"[:500])
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(after_step)
        on_step(0)

    def _start_cuda(self):
        self.finish = self.capture.start_cuda(self.torch, int(os.environ.get("MEMDIFF_RECORD_MAX_ENTRIES", "1000000")),
                                              os.environ.get("MEMDIFF_RECORD_STACKS", "all"))
        if os.environ.get(EMULATE):  # an emulated out-of-memory error is a Python exception: written at exit
            return
        observer = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if observer is not None:  # an OOM kills the rank: write what led to it first
            observer(lambda *_: self.write("out of memory"))

    def _stop_before_teardown(self):
        """Write when the default process group is destroyed, before its threads are joined."""
        dist = sys.modules.get("torch.distributed")
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        real = getattr(c10d, "destroy_process_group", None)
        if real is None:
            return
        recording = self

        def destroy_process_group(group=None, *args, **kwargs):
            if group is None or group is getattr(getattr(c10d, "GroupMember", None), "WORLD", None):
                recording.write("destroy_process_group")
            return real(group, *args, **kwargs)
        destroy_process_group.__doc__ = real.__doc__
        destroy_process_group.__wrapped__ = real
        c10d.destroy_process_group = destroy_process_group
        if dist is not None and getattr(dist, "destroy_process_group", None) is real:
            dist.destroy_process_group = destroy_process_group

    def _rank_from_process_group(self):
        """A process with no RANK (Lightning's ranks, torch.multiprocessing.spawn's) learns its rank when
        it makes the default process group of a job of more than one."""
        dist = sys.modules.get("torch.distributed")
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        real = getattr(c10d, "init_process_group", None)
        if real is None or self._status.rank is not None:
            return
        status = self._status

        def init_process_group(*args, **kwargs):
            out = real(*args, **kwargs)
            try:
                world = c10d.get_world_size()
                if world > 1:
                    status.became(c10d.get_rank(), world)
            except Exception as exc:  # the program goes on with the pid's name
                _say(f"process {os.getpid()}: its rank is unknown: {type(exc).__name__}: {exc}")
            return out
        init_process_group.__doc__ = real.__doc__
        init_process_group.__wrapped__ = real
        c10d.init_process_group = init_process_group
        if dist is not None and getattr(dist, "init_process_group", None) is real:
            dist.init_process_group = init_process_group

    def _write_on_sigterm(self):
        """Write, then die of SIGTERM as the process would have: only where nobody else handles it. SIGHUP
        likewise (a closed terminal, `memdiff record` hung up passing it on): it ended the process unwritten;
        one ignored (under `nohup`) stays ignored."""
        recording = self

        def on_sigterm(signum, frame):
            if recording.writing:  # the rank is writing already (at exit, say): let it finish first
                recording.terminated = signum
                return
            recording.write(signal.Signals(signum).name)
            _die_of(signum)
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) is not signal.SIG_DFL:
                continue
            try:
                signal.signal(s, on_sigterm)
            except ValueError:  # torch imported off the main thread: no handler can be set there
                return


def _die_of(signum):
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _end_with_lease():
    """A rank run by a Dask worker dies with the worker (SIGKILL, as its task kills it when orphaned):
    a worker killed under it cannot end it, and Dask runs its task again elsewhere. The pipe's write end
    is the worker's alone, so the read here ends exactly when the worker is gone. Its own children
    do not watch it (the variable is taken out): they end with the rank."""
    fd = os.environ.pop(LEASE_FD, "")
    if not _digits(fd):
        return
    # A rank a Dask worker starts inherits what the worker ignores, and exec keeps an ignored signal
    # ignored: a worker started in the background by a shell (`dask worker ADDRESS &`, a CI runner's
    # step) ignores SIGINT, so the rank would sleep through the Ctrl-C memdiff passes on. It takes both
    # signals at their defaults, as memdiff's own children do.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = int(fd)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except OSError:  # not open in this process
        return
    read, kill, pid = os.read, os.kill, os.getpid()  # bound now: the emulated run patches the file world

    def watch():
        while True:
            try:
                if not read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        kill(pid, signal.SIGKILL)
    _thread.start_new_thread(watch, ())


def _memdiff():
    """memdiff's modules this hook uses, from the memdiff that started the job."""
    sys.path.insert(0, os.environ["MEMDIFF_PACKAGE_PARENT"])
    try:
        from memdiff.errors import InputError
        from memdiff.recording import capture
    finally:
        sys.path.pop(0)
    return InputError, capture


_OVERLAY = None  # this process's file calls routed through the run's overlay (held until it ends)


def _overlay_from_start():
    """Under `--emulate`, route this process's file calls through the run's overlay from its first
    line, whether or not it ever imports torch (a job's data-preparation step, a helper script)."""
    global _OVERLAY
    sys.path.insert(0, os.environ["MEMDIFF_PACKAGE_PARENT"])
    try:
        from memdiff.recording.emulate.overlay_calls import overlaid
    finally:
        sys.path.pop(0)
    _OVERLAY = overlaid()
    _OVERLAY.__enter__()


def _start(torch):
    InputError, capture = _memdiff()
    emulate = os.environ.get(EMULATE)
    if emulate:
        try:
            _emulate(emulate, InputError)
        except InputError as exc:  # the CUDA script cannot run without it: one line, exit 2
            _say(f"process {os.getpid()}: cannot emulate {emulate}: {exc}")
            _status.write("failed", at="import torch", error=f"cannot emulate {emulate}: {exc}"[:500])
            os._exit(2)
    recording = _Recording(torch, capture, _status)
    recording.start()
    return recording


_EMULATION = None  # the running emulation of this process (session.start's stack), kept alive
_EMULATOR = None  # its Emulator: the out-of-memory errors it raised go into the rank's status


def _emulate(key, input_error):
    """Run this process on the emulated GPU `key` from here on (`memdiff record --emulate GPU -o DIR/`):
    its cuda tensors on the meta device, torch.cuda answering as the GPU, process groups that do no
    communication. The emulator stays on until the process ends."""
    from memdiff.recording.emulate.escapes import escaped
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import start

    global _EMULATION, _EMULATOR
    _EMULATOR = Emulator(gpu(key))
    _EMULATION = start(_EMULATOR)  # held, never closed: the emulator stays on until the process ends
    previous = sys.excepthook

    def refused(kind, value, traceback):
        # The emulator refusing an op, or a call that went around it to CUDA itself: one line naming
        # what and the script's line, as one process records it, and exit 2 (the rank's snapshot up
        # to there is written at exit).
        if not isinstance(value, input_error) and isinstance(value, Exception):
            value = escaped(value) or value
        if isinstance(value, input_error):
            rank = _status.rank if _status.rank is not None else os.environ.get("RANK")
            _say(f"rank {rank}: {value}" if rank is not None else f"process {os.getpid()}: {value}")
            sys.stderr.flush()
            _refused.append(str(value)[:500])
            _exit_status[0] = 2
            return
        previous(kind, value, traceback)
    sys.excepthook = refused
    atexit.register(_exit_with_status)  # registered first: runs after the recording is written


# An exit status to end with instead of Python's own (1 after an uncaught exception).
_exit_status = [None]
# What the emulator refused in this process, told to `memdiff record` in the rank's status.
_refused: list = []


def _exit_with_status():
    if _exit_status[0] is not None:
        sys.stdout.flush()
        os._exit(_exit_status[0])


class _AfterImport:
    """A meta path finder that lets the import of each module it watches run, then calls that module's
    callback with it. It only ever wraps the loader the other finders give: a spec asked for without
    an import (`importlib.util.find_spec`) runs nothing, and the finder stays until the module has run."""

    def __init__(self, callbacks):
        self.callbacks = callbacks  # module name -> called once its module has run, and then dropped

    def find_spec(self, name, path=None, target=None):
        if name not in self.callbacks or self not in sys.meta_path:
            return None
        # As the import system would have gone on: the finders after this one.
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a namespace package, or a loader shared by every module it loads: left alone
        run_module, finder = loader.exec_module, self

        def exec_module(module):
            try:
                run_module(module)  # an import that fails leaves the hook in place for the next try
            except BaseException as exc:
                finder.failed(name, exc)
                raise
            if getattr(module, "__name__", None) == name:
                finder.ran(name, module)
        loader.exec_module = exec_module
        return spec

    def failed(self, name, exc):
        """`name`'s module raised `exc` as it ran (a Ctrl-C in the middle of `import torch`): said, should
        the process end without importing it."""
        if name == "torch":
            error = f"its import of torch raised {type(exc).__name__}"
            _status.write(_status.state, **{**_status.last, "error": error})

    def ran(self, name, module):
        """`name`'s module has run: its callback, the first time only (a re-import or a reload runs it again)."""
        with _lock:
            callback = self.callbacks.pop(name, None)
            if not self.callbacks and self in sys.meta_path:
                sys.meta_path.remove(self)
        if callback is not None:
            callback(module)


# One import finishing at a time: two threads importing torch must not both start recording.
_lock = _thread.allocate_lock()


def _torch_ran(module):
    """torch's module has run in this process: record it from here on, on the main thread. torch's
    modes (the emulator's) are per thread, and the main thread is the one that runs the script: an
    `import torch` on another thread starts the recording there, at its next line."""
    if _thread.get_ident() == _MAIN_THREAD:
        _start_recording(module)
        return
    try:
        import ctypes

        def call(_):
            _start_recording(module)
            return 0
        pending = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(call)
        _kept.append(pending)  # the C callback must outlive this call
        add = ctypes.pythonapi.Py_AddPendingCall
        add.argtypes, add.restype = [type(pending), ctypes.c_void_p], ctypes.c_int
        if add(pending, None) == 0:
            return
    except Exception:  # no ctypes here: on this thread, then (its modes this thread's only)
        pass
    _start_recording(module)


_MAIN_THREAD = _thread.get_ident()  # Python runs sitecustomize on the main thread
_kept: list = []


def _start_recording(module):
    held, recording = [], None
    try:
        # A Ctrl-C while recording starts is held until it has: raised in the middle, it would leave a
        # profiler running and nothing to stop it.
        with _memdiff()[1].sigint_held() as held:
            recording = _start(module)
    except Exception as exc:
        _say(f"not recording process {os.getpid()}: {type(exc).__name__}: {exc}")
        _status.write("failed", at="import torch", error=f"{type(exc).__name__}: {exc}"[:500])
    if held:
        # Raised now, it fails the script's `import torch` and takes torch out of sys.modules, which a
        # write at exit would import again (and fail at): this process ends here, written first.
        if recording is not None:
            recording.write("Ctrl-C")
        signal.raise_signal(signal.SIGINT)


def _subprocess_ran(module):
    """Note each process this one starts whose environment drops this hook: it will not be recorded, and
    `memdiff record` says which and why instead of guessing."""
    popen = module.Popen
    real = popen.__init__

    def __init__(self, args, *rest, **kwargs):
        try:
            _check_child(args, real, rest, kwargs)
        except Exception:  # never in the way of the program's own subprocess
            pass
        real(self, args, *rest, **kwargs)
    __init__.__wrapped__ = real
    popen.__init__ = __init__


def _check_child(args, real, rest, kwargs):
    code = real.__code__
    position = code.co_varnames[:code.co_argcount].index("env") - 2  # after self and args
    env = kwargs.get("env", rest[position] if len(rest) > position else None)
    env = os.environ if env is None else env
    command = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in command]
    why = None
    if not env.get("MEMDIFF_RECORD_DIR"):
        why = "its environment has no MEMDIFF_RECORD_DIR"
    elif HERE not in [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]:
        why = "its PYTHONPATH does not have memdiff's hook"
    elif words and os.path.basename(words[0]).startswith("python"):
        for word in words[1:]:
            if not word.startswith("-") or word.startswith("--") or word in ("-m", "-c"):
                break
            ignored = sorted(set(word[1:]) & set("IES"))
            if ignored:
                why = f"python -{ignored[0]} ignores PYTHONPATH or sitecustomize"
                break
    if why is not None:
        with _lock:
            _status.started_without_hook.append(f"`{' '.join(words)[:200]}`: {why}")
        _status.write(_status.state, **_status.last)


def _lightning_ran(module):
    """A Lightning launcher's module has run: its ranks stop as torchrun's do (memdiff's lightning_stop.py)."""
    sys.path.insert(0, os.environ["MEMDIFF_PACKAGE_PARENT"])
    try:
        from memdiff.recording import lightning_stop

        lightning_stop.patch(module)
    except Exception as exc:  # the job runs on, stopped as Lightning stops it
        _say(f"process {os.getpid()}: {module.__name__} is not patched: {type(exc).__name__}: {exc}")
    finally:
        sys.path.pop(0)


def _watch_for_death():
    """Say in the status what ends this process, when it fails: an uncaught exception (its line, and the
    line of the script it came from), or `sys.exit` with a failing status (torch.multiprocessing's
    ranks end so after an exception, which it catches)."""
    previous_hook, real_exit = sys.excepthook, sys.exit

    def excepthook(kind, value, traceback):
        if isinstance(value, Exception):
            _status.ended(_exception_line(value, traceback))
        previous_hook(kind, value, traceback)

    def exit(status=None):
        caught = sys.exc_info()[1]
        # Lightning's Trainer ends a Ctrl-C with sys.exit(1): a stop, as KeyboardInterrupt itself is, no death
        if status not in (None, 0) and not isinstance(caught, KeyboardInterrupt):
            if isinstance(caught, Exception):
                _status.ended(_exception_line(caught, caught.__traceback__))
            else:
                _status.ended(f"exit status {status}" if isinstance(status, int) else str(status))
        real_exit(status)
    exit.__doc__ = real_exit.__doc__
    sys.excepthook, sys.exit = excepthook, exit


def _exception_line(value, traceback):
    """`RuntimeError: message (file.py:12)`: the exception's first line and the innermost frame it was raised at."""
    text = str(value).strip().splitlines()
    libraries = tuple(os.path.join(p, "lib") for p in {sys.prefix, sys.base_prefix})
    # memdiff's own frames are not the user's, installed or not (an editable install is no site-packages)
    libraries += (os.path.join(os.environ.get("MEMDIFF_PACKAGE_PARENT", "/nonexistent"), "memdiff") + os.sep,)
    where = None  # the innermost frame of the user's own code, else the innermost
    while traceback is not None:
        name = traceback.tb_frame.f_code.co_filename
        if where is None or not (name.startswith(libraries) or "site-packages" in name or name.startswith("<")):
            where = f"{name}:{traceback.tb_lineno}"
        traceback = traceback.tb_next
    return f"{type(value).__name__}{': ' + text[0] if text else ''}{f' (at {where})' if where else ''}"


def _exit_without_torch():
    if _status.state == "before torch":
        _status.write("no torch", **_status.last)


def _chain():
    """Run the sitecustomize this one hides (a user's, or the distribution's), as Python would have."""
    mine = sys.modules.pop("sitecustomize", None)
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        sys.modules["sitecustomize"] = mine
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("MEMDIFF_RECORD_DIR"):
    if _digits(os.environ.get("RANK", "")) and OWNER not in os.environ:
        # The first process with a RANK is that rank; whatever it starts inherits this and is not.
        os.environ[OWNER] = str(os.getpid())
    _status = _Status(os.environ["MEMDIFF_RECORD_DIR"])
    _status.write("before torch")
    _end_with_lease()
    if os.environ.get(EMULATE) and os.environ.get("MEMDIFF_OVERLAY"):
        _overlay_from_start()
    atexit.register(_exit_without_torch)
    _watch_for_death()
    watched = {}
    if "subprocess" in sys.modules:
        _subprocess_ran(sys.modules["subprocess"])
    else:
        watched["subprocess"] = _subprocess_ran
    if "torch" not in sys.modules:
        watched["torch"] = _torch_ran
    watched.update((name, _lightning_ran) for name in LIGHTNING_LAUNCHERS if name not in sys.modules)
    if watched:
        sys.meta_path.insert(0, _AfterImport(watched))
    if "torch" in sys.modules:  # imported before this file ran (a .pth file): recorded from here
        _torch_ran(sys.modules["torch"])
_chain()
