"""Programs the emulated run starts (`rm`, `cp`, `tar`, `git`, a shell) write into the run's overlay too.

overlay_calls.py routes Python's file calls; a program the script starts is no Python and went
around them: `os.system("rm -rf ckpt")` deleted the user's checkpoint, and memdiff could only say so
afterwards. Here each such program runs in a Linux mount namespace (a user namespace too, where
memdiff is not root) in which every folder memdiff watches (the working folder and the script's:
TREES, which overlay_calls.for_run sets) is a kernel overlayfs mount:

    lowerdir = <memdiff's upper copy of the folder, where the run wrote there>:<the folder itself>
    upperdir, workdir = fresh folders in the run's scratch

so the program reads the user's files and the run's earlier Python writes, and what it writes lands
in the kernel's upper folder. memdiff's own paths (the overlay, its scratch, the snapshot) and the
mounts below a watched folder are bound back over the overlay as they are: a Python child inside a
shell is emulated as any other and writes through memdiff's routes. After the program ends, the
parent that forked it (outside the namespace) takes the kernel's upper folder into memdiff's overlay
through its own calls (merge): files, folders and links are the run's writes, whiteouts its
deletions, opaque folders a folder removed and made again. The end of the run lists them as every
other write of the run.

A launch is wrapped by starting this module's `main` (a bare `python -I -S`) with the program after
it; the wrapper's exit status is the program's (a signal included), its standard streams are the
program's, and a signal sent to the wrapper is passed on. Where the kernel refuses (no user
namespaces, no overlayfs in one, a container's seccomp), the first program says so once on stderr
with the error and runs as before: what it changes in the user's files is found after the run
(overlay_calls.TreeCheck), never silently. The answer is kept in `<overlay>/programs` for every
process of the run, so later programs are started as they are.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys

# The wrapper imports this file in a bare `python -I -S` for every program the run starts: it imports
# what it uses as it needs it, typing and memdiff's package only for the type checker (and the
# overlay only where a program wrote anything). With `signal` (enum), json, typing and the package
# imported at the top a program took 146 ms more than without the wrapper; now 45-90 ms (docs/emulate.md).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal
    from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

    from memdiff.recording.emulate.overlay import Overlay
else:  # the C module: `signal` imports enum, which was a third of the wrapper's start
    import _signal as signal

TREES = "MEMDIFF_OVERLAY_TREES"  # the folders memdiff watches, os.pathsep-separated (overlay_calls.for_run)
INSIDE = "MEMDIFF_SANDBOXED"  # set for a program inside the namespace: what it starts is inside already
STATE = "programs"  # in the overlay's folder: "sandboxed", or "refused: why" (said once, then believed)
OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")
# Signals sent to the wrapper by a process (Popen.terminate, kill) go on to the program; a terminal's
# Ctrl-C reaches the program itself (its process group), so one the kernel sent is not sent twice.
PASSED_ON = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
             if hasattr(signal, name)}  # all of them on Linux, the only system that wraps
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RDONLY = 4096, 16384, 1 << 18, 1
_MNT_DETACH, _PR_SET_PDEATHSIG = 2, 1
# The wrapper imports this file as a module of its own folder (its bytecode cached beside it, as the
# package's), which is left on the path no longer than the import.
_BOOT = "import sys; sys.path.append(sys.argv[1]); import programs; sys.path.pop(); programs.main(sys.argv[2:])"
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_real_open = open
_state: Dict[str, str] = {}  # this process's reading of <overlay>/programs, by overlay folder


# -- in the run's processes: which launches are wrapped ----------------------------------------------

def routes(overlay: Overlay) -> List[Tuple[Any, str, Any]]:
    """The replacements of subprocess's and os's ways to start a program that run a non-Python one
    inside the sandbox; none where no folder is watched, inside a sandbox already, or where the
    kernel refused it earlier in the run."""
    trees = [t for t in os.environ.get(TREES, "").split(os.pathsep) if t]
    if not trees or os.environ.get(INSIDE) or sys.platform != "linux" or _refused(overlay.root):
        return []
    import shutil
    import subprocess

    own = [overlay.root, overlay.scratch, *overlay.owned]
    config = [overlay.root, _PACKAGE_PARENT, str(len(trees)), *trees, str(len(own)), *own]
    popen_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    real_system, real_execv, real_execve = os.system, os.execv, os.execve
    real_spawn, real_spawnp = os.posix_spawn, os.posix_spawnp

    def wrap(executable: Any, argv: Sequence[Any], env: Any, search: bool, cwd: Any = None) -> Optional[List[str]]:
        """The wrapper's command for `executable` run as `argv` (a relative one from `cwd`, where the
        child goes first), or None: a Python program, one not found (the real call says so), or a
        sandbox refused."""
        if _refused(overlay.root):
            return None
        path = os.fsdecode(executable)
        if search and os.sep not in path:
            path = shutil.which(path, path=(env if env is not None else os.environ).get("PATH", os.defpath)) or ""
        elif cwd is not None and not os.path.isabs(path):
            path = os.path.join(os.fsdecode(cwd), path)
        if not path or not os.access(path, os.X_OK) or os.path.isdir(path) or _python(path):
            return None
        return [sys.executable, "-I", "-S", "-B", "-c", _BOOT, _HERE, *config, os.path.abspath(path), "--",
                *(os.fsdecode(a) for a in argv)]

    def execute_child(self: Any, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                      cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: Any, *rest: Any) -> Any:
        # subprocess's own reading of args, shell and executable, then the program it would exec
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if shell:
            argv = ["/bin/sh", "-c", *argv]
            if executable:
                argv[0] = executable
        wrapped = wrap(executable if executable is not None else argv[0], argv, env, search=True, cwd=cwd)
        if wrapped is not None:
            args, executable, shell = wrapped, None, False
        return popen_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                           creationflags, shell, *rest)

    def system(command: Any) -> int:
        wrapped = wrap("/bin/sh", ["/bin/sh", "-c", os.fsdecode(command)], None, search=False)
        if wrapped is None:
            return real_system(command)
        import shlex

        return real_system("exec " + shlex.join(wrapped))  # the shell gives way: its status is the program's

    def execv(path: Any, argv: Any) -> None:
        wrapped = wrap(path, list(argv), None, search=False)
        if wrapped is None:
            real_execv(path, argv)
        else:
            real_execv(wrapped[0], wrapped)

    def execve(path: Any, argv: Any, env: Any) -> None:
        wrapped = wrap(path, list(argv), env, search=False) if not isinstance(path, int) else None
        if wrapped is None:
            real_execve(path, argv, env)
        else:
            real_execve(wrapped[0], wrapped, env)

    def spawning(real: Callable[..., int], search: bool) -> Callable[..., int]:
        def spawn(path: Any, argv: Any, env: Any, **kwargs: Any) -> int:
            wrapped = wrap(path, list(argv), env, search=search)
            return real(path, argv, env, **kwargs) if wrapped is None else real_spawn(wrapped[0], wrapped, env,
                                                                                       **kwargs)
        return spawn

    # os.popen, os.spawn*, os.exec[lv]p* and asyncio's subprocesses go through these
    return [(subprocess.Popen, "_execute_child", execute_child), (os, "system", system), (os, "execv", execv),
            (os, "execve", execve), (os, "posix_spawn", spawning(real_spawn, False)),
            (os, "posix_spawnp", spawning(real_spawnp, True))]


def _python(path: str) -> bool:
    """Whether `path` runs Python (python3, or a script whose #! names it: torchrun, accelerate):
    started as it is, emulated by memdiff's hook, its own programs wrapped in turn."""
    if os.path.basename(path).startswith("python"):
        return True
    try:
        with _real_open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


def _refused(root: str) -> bool:
    """Whether the kernel refused the sandbox earlier in this run (said once, by the first program)."""
    if root not in _state:
        try:
            with _real_open(os.path.join(root, STATE), encoding="utf-8") as f:
                said = f.read()
        except OSError:
            return False
        if not said:
            return False  # being written by the program that found out
        _state[root] = said
    return _state[root].startswith("refused")


# -- the wrapper: a parent outside the namespace, the program in it ----------------------------------

def main(args: List[str]) -> None:
    """Run the program after `--` in the sandbox that `args` describe before it (the overlay's folder,
    memdiff's package's, the watched folders and memdiff's own paths, each list after its length,
    and the program's file), take what it wrote into the overlay, and end as it ended."""
    config, argv = _config(args[:args.index("--")]), args[args.index("--") + 1:]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # inherited SIG_IGN would reap the program unseen
    try:
        places = _places(config)
        libc = ctypes.CDLL(None, use_errno=True)
    except Exception as exc:  # the program runs all the same, as where the kernel refuses
        _refusal(config["root"], f"refused: {type(exc).__name__}: {exc}")
        os.execv(config["exe"], argv)
    read, write = os.pipe()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON | {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:  # the program's side: single-threaded, so Python is safe here until exec
        try:
            _child(libc, config, places, argv, write, mask)
        finally:
            os._exit(127)  # never back into the wrapper's own code
    os.close(write)
    said = b""
    while True:
        chunk = os.read(read, 512)
        if not chunk:
            break
        said += chunk
    os.close(read)
    status = _waited(pid)
    root = config["root"]
    if said == b"sandboxed":
        _keep_state(root, "sandboxed")
        try:
            written = [(tree, upper) for tree, upper in places["uppers"] if os.listdir(upper)]
            if written:  # a program that only read (git rev-parse, nproc) has nothing to take
                sys.path.insert(0, config["package"])
                from memdiff.recording.emulate.overlay import Overlay

                overlay = Overlay(root, config["own"])
                for tree, upper in written:
                    merge(overlay, upper, tree)
        except Exception as exc:  # never in the way of the program's status: said, as a writer outside is
            print(f"memdiff: emulation: what {argv[0]} wrote could not all be taken into the run's overlay: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
    elif said:
        _refusal(root, said.decode())
    _tidy(places["folder"])
    sys.stderr.flush()
    _end_as(status, mask)


def _refusal(root: str, said: str) -> None:
    """Keep the run's answer that programs are not sandboxed, and say it where this is the first."""
    if _keep_state(root, said):
        print(f"memdiff: emulation: programs the run starts are not sandboxed ({said[len('refused: '):]}): what "
              f"they change in your files is found after the run, not kept from it", file=sys.stderr, flush=True)


def _child(libc: Any, config: Dict[str, Any], places: Dict[str, Any], argv: List[str], write: int,
           mask: Any) -> None:
    """The forked child: the sandbox entered (or why not, written to the parent), then the program."""
    try:
        _enter(libc, config, places)
        said = b"sandboxed"
    except OSError as exc:
        said = f"refused: {exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})".encode()
    except Exception as exc:  # a memdiff bug: the program still runs, as it would where refused
        said = f"refused: {type(exc).__name__}: {exc}".encode()
    os.write(write, said)
    os.close(write)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the wrapper killed (Popen.kill): the program too
    try:
        os.execv(config["exe"], argv)
    except OSError as exc:
        os.write(2, f"{argv[0]}: {exc.strerror}\n".encode())


def _config(words: List[str]) -> Dict[str, Any]:
    trees = int(words[2])
    own = int(words[3 + trees])
    return {"root": words[0], "package": words[1], "trees": words[3:3 + trees],
            "own": words[4 + trees:4 + trees + own], "exe": words[4 + trees + own]}


def _places(config: Dict[str, Any]) -> Dict[str, Any]:
    """The kernel's upper and work folders of each watched folder (nested ones are in the outer
    one's mount), fresh in the run's scratch: outside the watched folders, memdiff's own."""
    overlay_scratch = os.path.realpath(os.path.join(config["root"], "scratch"))
    folder = os.path.join(overlay_scratch, "programs", os.urandom(4).hex())
    trees: List[str] = []
    for tree in sorted({os.path.realpath(t) for t in config["trees"]}, key=len):
        if tree != os.sep and os.path.isdir(tree) and not any(_below(tree, t) for t in trees):
            trees.append(tree)
    uppers, mounts = [], []
    for i, tree in enumerate(trees):
        copy = os.path.join(config["root"], "upper", tree.lstrip(os.sep))
        run_copy = copy if os.path.isdir(copy) else None
        # the run's copy inside the folder itself needs an overlay of its own (_enter), and its folders
        kinds = ("upper", "work") + (("middle", "empty") if run_copy and _below(run_copy, tree) else ())
        made = {k: os.path.join(folder, f"{i}-{k}") for k in kinds}
        for path in made.values():
            os.makedirs(path)
        mounts.append((tree, made, run_copy))
        uppers.append((tree, made["upper"]))
    return {"folder": folder, "uppers": uppers, "mounts": mounts}


def _below(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _escaped(path: str) -> str:
    """A path in overlayfs' options, where `,` and `:` separate and `\\` escapes."""
    return path.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def _call(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _enter(libc: Any, config: Dict[str, Any], places: Dict[str, Any]) -> None:
    """In the forked child: its own mount namespace (and user namespace, not as root) with each
    watched folder an overlay, memdiff's paths and the mounts below bound back; the working folder
    entered again through it. Raises OSError where the kernel refuses (all undone)."""
    if not places["mounts"]:
        raise OSError(errno.ENOENT, "no folder to watch but /")
    uid, gid = os.geteuid(), os.getegid()
    _call(libc.unshare(_CLONE_NEWNS | (_CLONE_NEWUSER if uid else 0)), "unshare")
    if uid:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with _real_open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _call(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    trees = [tree for tree, _, _ in places["mounts"]]
    # what stays as it is inside: memdiff's own paths, and the mounts below a watched folder (which an
    # overlay of the folder would show empty); opened before the overlays hide them
    kept = sorted({os.path.realpath(p) for p in config["own"] if os.path.lexists(p)} | set(_mounts_below(trees)),
                  key=len)
    held = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in kept
            if any(_below(p, t) and p != t for t in trees)]
    seen_cwd = _seen(config["root"], os.getcwd())
    user = ",userxattr" if uid else ""
    made: List[str] = []
    try:
        for tree, place, run_copy in places["mounts"]:
            lower = _escaped(tree)
            if run_copy is not None:
                if _below(run_copy, tree):
                    # the kernel refuses a layer inside another (ELOOP): the run's copy, inside the
                    # folder where memdiff's overlay lies in it, is given through an overlay of its own
                    _mount(libc, "overlay", place["middle"], "overlay", _MS_RDONLY,
                           f"lowerdir={_escaped(run_copy)}:{_escaped(place['empty'])}{user}", made)
                    run_copy = place["middle"]
                lower = f"{_escaped(run_copy)}:{lower}"
            _mount(libc, "overlay", tree, "overlay", 0,
                   f"lowerdir={lower},upperdir={_escaped(place['upper'])},workdir={_escaped(place['work'])},"
                   f"redirect_dir=nofollow,index=off,metacopy=off{user}", made)
        for path, fd in held:
            _mount(libc, f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC, None, made)
    except OSError:
        for target in reversed(made):
            libc.umount2(target.encode(), _MNT_DETACH)
        raise
    for _, fd in held:
        os.close(fd)
    os.chdir(seen_cwd if os.path.isdir(seen_cwd) else os.getcwd())
    os.environ[INSIDE] = "1"


def _mount(libc: Any, source: str, target: str, kind: Optional[str], flags: int, options: Optional[str],
           made: List[str]) -> None:
    _call(libc.mount(source.encode(), target.encode(), kind.encode() if kind else None, flags,
                     options.encode() if options else None), f"mount {kind or 'bind'} on {target}")
    made.append(target)


def _seen(root: str, cwd: str) -> str:
    """The working folder as the script names it: a folder only the run made is entered through the
    overlay's copy (overlay_calls' chdir), which inside the namespace is at its own path."""
    upper = os.path.join(root, "upper")
    return cwd[len(upper):] if cwd.startswith(upper + os.sep) else cwd


def _mounts_below(trees: List[str]) -> List[str]:
    """Mount points strictly below a watched folder (a data volume in the project), from mountinfo."""
    found = []
    with _real_open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = line.split(" ")[4]
            point = point.encode().decode("unicode_escape") if "\\" in point else point
            if any(_below(point, t) and point != t for t in trees):
                found.append(point)
    return found


def _waited(pid: int) -> int:
    """The program's wait status; signals sent to the wrapper by a process passed on meanwhile."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return status
        info = signal.sigwaitinfo(PASSED_ON | {signal.SIGCHLD})
        if info.si_signo != signal.SIGCHLD and info.si_code <= 0:  # kill(), sigqueue(), tkill(): a process's
            os.kill(pid, info.si_signo)


def _end_as(status: int, mask: Any) -> None:
    """Exit as the program did: its code, or the signal that ended it."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number != signal.SIGKILL:
            signal.signal(number, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set(mask) - {number})
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


def _keep_state(root: str, said: str) -> bool:
    """Write the run's answer once; whether this process wrote it (and so says it)."""
    try:
        fd = os.open(os.path.join(root, STATE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(said)
    return True


def _tidy(folder: str) -> None:
    """Remove the kernel's folders: empty ones one by one (a program that only read: no shutil to
    import), else the lot."""
    try:
        for name in os.listdir(folder):
            if name.endswith("-work"):
                os.rmdir(os.path.join(folder, name, "work"))  # overlayfs' own, left empty and unreadable
            os.rmdir(os.path.join(folder, name))
        os.rmdir(folder)
    except OSError:
        import shutil

        for below, dirs, _ in os.walk(folder):
            for name in dirs:
                os.chmod(os.path.join(below, name), 0o700)
        shutil.rmtree(folder, ignore_errors=True)


# -- what the program wrote, taken into memdiff's overlay ---------------------------------------------

def merge(overlay: Overlay, upper: str, tree: str) -> None:
    """The kernel's upper folder `upper` of a program's mount over `tree`, taken into `overlay` through
    its own calls: a whiteout (a character device 0/0) is a deletion, an opaque folder one removed
    and made again, a folder, file or link the run's own. memdiff's own paths are passed over."""
    for name in sorted(os.listdir(upper)):
        source, path = os.path.join(upper, name), os.path.join(tree, name)
        if overlay.passes(path) or name.startswith(".memdiff-writes-"):
            continue
        info = os.lstat(source)
        seen = _kind(overlay, path)
        if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
            overlay.erase(path)
        elif stat.S_ISDIR(info.st_mode):
            if _opaque(source) or (seen is not None and not stat.S_ISDIR(seen)):
                overlay.erase(path)
                seen = None
            if seen is None:
                overlay.make_folder(path)
            if seen is None or stat.S_IMODE(seen) != stat.S_IMODE(info.st_mode):
                os.chmod(overlay.folder(path), stat.S_IMODE(info.st_mode))
            merge(overlay, source, path)
        elif stat.S_ISLNK(info.st_mode):
            overlay.erase(path)
            overlay.make_link(os.readlink(source), path)
        elif stat.S_ISREG(info.st_mode):
            if seen is not None and not stat.S_ISREG(seen):  # a link or folder replaced by a file
                overlay.erase(path)
            target = overlay.writable(path, keep=False)
            try:
                os.replace(source, target)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                import shutil

                shutil.copy2(source, target)
        # a socket or fifo a program left: nothing a run's files keep


def _kind(overlay: Overlay, path: str) -> Optional[int]:
    """The mode of what the run sees at `path` (a link not followed), None where nothing is."""
    real = overlay.where(path, follow=False)
    try:
        return os.lstat(real).st_mode if real is not None else None
    except OSError:
        return None


def _opaque(folder: str) -> bool:
    for name in OPAQUE:
        try:
            if os.getxattr(folder, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False

