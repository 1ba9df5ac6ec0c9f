"""Private files in a shared filesystem: what the agent writes may reveal code paths, data shapes and
file names, and a run directory under a shared path can be pre-planted with links by another user.

- directories are created 0700; a pre-existing one the agent names itself (``./hpar-runs``, the
  default run dir in it, the evidence dir) must be a real directory (not a symlink) owned by us, and
  is tightened to 0700;
- files are opened with ``O_NOFOLLOW`` (a planted symlink fails instead of redirecting the write),
  created 0600, and an existing file must be a regular file owned by us with one link;
- whole files (summaries) are written to a temp file in the same directory and renamed over the
  target, so a reader never sees a half-written file and a full disk leaves the old one intact;
- logs rotate at a size cap (``RotatingFile``);
- every file the agent or its tools read or write is opened non-blocking and checked with ``fstat``
  to be a regular file (``open_regular``, ``open_private``): a FIFO, socket or device in its place
  is refused with its kind named (``NotRegularError``) instead of blocking the caller forever, and
  swapping the file between a check and the open changes nothing.

Every function raises ``OSError`` (``UnsafePathError`` for a refused path); callers count it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
from typing import IO

#: Where run directories go when none is named (relative to the working directory).
RUNS_DIR = "hpar-runs"
DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


_orphans: list[IO[str]] = []  # file objects a forked child must not flush or close


class UnsafePathError(OSError):
    """A path the agent refuses to use (a symlink, another owner's file or directory, a hard link)."""


class NotRegularError(UnsafePathError):
    """A FIFO, socket, device or directory where a file was expected; ``kind`` says which."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path, self.kind = path, kind


def kind(mode: int) -> str | None:
    """What a file of this mode is, in words ("a FIFO"); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_a_directory(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a directory, in the words every tool uses ("not found", "a symbolic link
    loop", "a FIFO, not a directory"); None for a directory (symlinks followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        if exc.errno == errno.ENOENT:
            return "a dangling symbolic link" if os.path.islink(path) else "not found"
        return exc.strerror or str(exc)
    return None if stat.S_ISDIR(mode) else f"{kind(mode) or 'a regular file'}, not a directory"


def open_regular(path: str | os.PathLike[str]) -> int:
    """A blocking read-only fd of ``path`` (symlinks followed), which must be a regular file.

    Opened with ``O_NONBLOCK`` (a FIFO without a writer opens at once rather than waiting for one) and
    checked with ``fstat`` on the fd: ``NotRegularError`` names a FIFO, socket or device, whatever was
    at the path before the open."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC | _NOCTTY)
    except OSError as exc:  # a socket: ENXIO, which says nothing
        _name_kind(path, exc)
        raise
    try:
        what = kind(os.fstat(fd).st_mode)
        if what is not None:
            raise NotRegularError(os.fspath(path), what)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _name_kind(path: str | os.PathLike[str], exc: OSError) -> None:
    """Raise ``NotRegularError`` for ``exc`` when ``path`` is a special file."""
    what = None
    with contextlib.suppress(OSError):
        what = kind(os.stat(path).st_mode)
    if what is not None:
        raise NotRegularError(os.fspath(path), what) from exc


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file ``path``; ``OSError`` when it is over ``limit`` bytes."""
    with os.fdopen(open_regular(path), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
    return data


def _makedirs(path: str) -> None:
    """``os.makedirs`` with every directory it creates 0700 (its ``mode`` is the leaf's only); raises
    ``FileExistsError`` when ``path`` exists."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not missing:
        raise FileExistsError(path)
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if d == missing[0]:
                raise  # created by another process meanwhile: the caller checks it
            continue


def private_dir(path: str, *, chosen: bool = False) -> str:
    """Create ``path`` (and missing parents) 0700, or check and tighten the existing directory.

    ``chosen``: the user named this directory (``HPAR_RUN_DIR``); an existing one is used as it is
    (it may be a link to scratch space or a group directory on purpose). What the agent creates in it
    is still private, and a directory the agent names itself is always checked."""
    try:
        _makedirs(path)
    except FileExistsError:
        if chosen:
            if not os.path.isdir(path):
                raise UnsafePathError(f"{path} exists and is not a directory") from None
            return path
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path} is a symbolic link; the agent does not write through it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} exists and is not a directory")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path} belongs to uid {st.st_uid}, not to this process; choose another run dir"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)  # owner keeps its bits; group/others none
    return path


def default_run_dir(name: str) -> str:
    """``hpar-runs/<name>`` in the working directory, with ``hpar-runs`` checked as the run dir is: a
    link there would send every run's files wherever it points, so it is refused like a linked run dir
    (a directory named in ``HPAR_RUN_DIR`` may be a link on purpose)."""
    try:
        private_dir(RUNS_DIR)
    except UnsafePathError as exc:
        raise UnsafePathError(
            f"{exc} (name the directory, in HPAR_RUN_DIR or a tool's --run-dir, to write through a link)"
        ) from None
    return private_dir(os.path.join(RUNS_DIR, name))


def _check_fd(fd: int, path: str) -> None:
    st = os.fstat(fd)
    what = kind(st.st_mode)
    if what is not None:
        raise NotRegularError(path, what)
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this process")
    if st.st_nlink > 1:
        raise UnsafePathError(f"{path} has {st.st_nlink} hard links; the agent does not write through it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, FILE_MODE)


def open_private(path: str, *, append: bool = True, exclusive: bool = False, readable: bool = False) -> int:
    """An fd for writing ``path`` (and reading it, ``readable``: a shared mapping needs both): never
    through a symlink, 0600, close-on-exec."""
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _NONBLOCK
    flags |= os.O_EXCL if exclusive else 0
    flags |= os.O_APPEND if append else os.O_TRUNC
    if not append and not exclusive:
        flags &= ~os.O_TRUNC  # truncate only after the checks below
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePathError(f"{path} is a symbolic link; the agent does not write through it") from exc
        _name_kind(path, exc)  # a FIFO without a reader: ENXIO, which says nothing
        raise
    try:
        _check_fd(fd, path)
        os.set_blocking(fd, True)
        if not append and not exclusive:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new(path: str, data: bytes) -> None:
    """Create ``path`` (it must not exist) with ``data``."""
    fd = open_private(path, append=False, exclusive=True)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: readers see the old or the new file, never a part."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)  # O_EXCL, 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
        os.replace(tmp, path)  # replaces a planted symlink itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class RotatingFile:
    """An append-only text file that rotates to ``path.1`` .. ``path.<backups>`` at ``max_bytes``
    (0: never). Thread-safe; ``write`` raises ``OSError`` for the caller to count."""

    def __init__(self, path: str, max_bytes: int = 0, backups: int = 2) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.lock = threading.RLock()
        self._fh: IO[str] | None = None
        self._size = 0

    def _open(self) -> IO[str]:
        if self._fh is None:
            fd = open_private(self.path, append=True)
            self._fh = os.fdopen(fd, "a", buffering=1, encoding="utf-8")
            self._size = os.fstat(fd).st_size
        return self._fh

    def write(self, text: str) -> None:
        with self.lock:
            fh = self._open()
            n = len(text.encode("utf-8", "replace"))
            if self.max_bytes and self._size and self._size + n > self.max_bytes:
                self._rotate()
                fh = self._open()
            fh.write(text)
            fh.flush()
            self._size += n

    def _rotate(self) -> None:
        self.close()
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.lexists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)

    def close(self) -> None:
        with self.lock:
            if self._fh is not None:
                fh, self._fh = self._fh, None
                fh.close()

    def drop_in_child(self) -> None:
        """After fork: close the child's copy of the descriptor without flushing the parent's data."""
        fh, self._fh = self._fh, None
        if fh is not None:  # point the fd at /dev/null: fh may close it later, no lock is taken now
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_WRONLY | _CLOEXEC)
                os.dup2(null, fh.fileno(), inheritable=False)
                os.close(null)
            _orphans.append(fh)
