"""Whom a directory or file we keep blocks in can be written by: the checks of the disk
tier's directories and of the shared host pool file, after OpenSSH's ``StrictModes`` and
PostgreSQL's data directory check.

Blocks encode users' prompts and are read back into the KV cache, so whoever can write
where they live can plant a forged block or read others'. The rule: **a path only where
no other local user can write, for the whole path.** Three kinds of path:

- **Private** (the namespace directory, its 2-hex subdirectories, a host pool file): a
  real directory (or a regular file), never a symlink, owned by this process's effective
  uid, not writable by group or others.
- **The tier's root** (``DiskTier.path``, the host pool's directory) **and every
  directory above it**, as the kernel resolves the path: owned by us or by root, and
  writable by group or others only if sticky (``/tmp``, ``/dev/shm``: another user may
  add entries but not rename or remove ours). Whoever owns a directory, or may write a
  non-sticky one, can rename what is below it and plant a tree of their own at the old
  path. Every symlink the path passes through is owned by us or by root (another user's
  could be re-pointed).

The checks run once, when the tier opens (:func:`open_root_dir`); after that the tier
works relative to directory file descriptors it opened then and holds (``openat``, with
``O_NOFOLLOW`` at each step), so that nothing done to the directories above later (a
rename, a chmod) changes which files it reads and writes.

Each refusal is a ``PermissionError`` naming the path and what is wrong (owner uid
against ours, mode bits), and how to fix it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = [
    "check_private_dir",
    "check_private_file",
    "check_root_dir",
    "make_private_dir",
    "open_private_dir",
    "open_root_dir",
]

_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: Symlinks followed in one path before it counts as a loop (Linux's MAXSYMLINKS).
_MAX_LINKS = 40
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def _owner_problem(st: os.stat_result, allow_root: bool) -> str | None:
    uid = os.geteuid()
    if st.st_uid == uid or (allow_root and st.st_uid == 0):
        return None
    whom = f"this process's uid {uid}" + (" or root" if allow_root and uid != 0 else "")
    return f"owned by uid {st.st_uid}, not by {whom}"


def _refuse(what: str, path: os.PathLike[str] | str, problem: str, fix: str) -> PermissionError:
    return PermissionError(f"{what}: refusing {os.fspath(path)}: {problem}; {fix}")


def check_private_dir(
    path: os.PathLike[str] | str, what: str, dir_fd: int | None = None
) -> os.stat_result:
    """``path`` (not followed if a symlink; relative to ``dir_fd`` if given) must be a
    directory owned by us and not writable by group or others; its ``lstat``, or
    ``PermissionError`` saying why not."""
    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    _check_private_dir_stat(st, path, what)
    return st


def _check_private_dir_stat(st: os.stat_result, path: os.PathLike[str] | str, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(what, path, "a symlink", "it must be a real directory of this user")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, path, "not a directory", "remove it or choose another path")
    _check_ours(
        st,
        path,
        what,
        "another user could plant or read blocks there",
        f"chmod go-w {os.fspath(path)}",
    )


def check_private_file(fd: int, path: os.PathLike[str] | str, what: str) -> os.stat_result:
    """The open file ``fd`` (at ``path``) must be a regular file owned by us and not
    writable by group or others; its ``fstat``, or ``PermissionError`` saying why not."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(what, path, "not a regular file", "remove it or choose another path")
    _check_ours(
        st,
        path,
        what,
        "another user made it: remove it",
        "another user could write into it: remove it",
    )
    return st


def _check_ours(
    st: os.stat_result, path: os.PathLike[str] | str, what: str, foreign: str, writable: str
) -> None:
    """Owned by us, not writable by group or others, or ``PermissionError`` with the
    hint ``foreign`` or ``writable``."""
    owner = _owner_problem(st, allow_root=False)
    if owner is not None:
        raise _refuse(what, path, owner, foreign)
    if st.st_mode & _GROUP_OTHER_WRITE:
        raise _refuse(
            what,
            path,
            f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
            writable,
        )


def _check_trusted_dir(st: os.stat_result, at: str, path: str, what: str) -> None:
    """Directory ``at`` (the tier's root ``path`` or a directory above it) must be owned
    by us or root, and writable by group or others only if sticky."""
    above = at != path
    role = f"a directory above {path}" if above else "the tier's directory"
    owner = _owner_problem(st, allow_root=True)
    if owner is not None:
        raise _refuse(
            what,
            at,
            f"{owner}: its owner could rename {role if above else 'it'} and plant a tree of "
            "their own under the running engine",
            "choose a path whose every directory belongs to this user or to root",
        )
    if st.st_mode & _GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            what,
            at,
            f"writable by group or others and not sticky (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): anyone who may write it could swap "
            f"{path if above else 'what the tier keeps there'}",
            f"chmod go-w {at} (or o+t, as /tmp), or choose another path",
        )


def _resolve_checked(path: str, what: str, create: bool = False) -> tuple[str, os.stat_result]:
    """Resolve the absolute ``path`` one component at a time, as the kernel does, and
    check every directory it passes through (``/`` included) and every symlink it
    follows; the path without symlinks and its directory's ``stat``. ``create``: make
    the directories missing (mode 0700), each only once the one above it passed."""
    done: list[str] = []  # the components resolved so far (no symlink among them)
    todo = [part for part in path.split("/") if part]
    links = 0
    st = os.stat("/")
    _check_trusted_dir(st, "/", path, what)
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        at = "/" + "/".join([*done, part])
        try:
            st = os.lstat(at)
        except FileNotFoundError:
            if not create:
                raise
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(at, 0o700)
                st = os.lstat(at)
            except OSError as exc:
                raise OSError(exc.errno, f"{what}: cannot create {at}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            owner = _owner_problem(st, allow_root=True)
            if owner is not None:
                raise _refuse(
                    what,
                    at,
                    f"a symlink {owner}",
                    f"its owner could re-point it (it leads to {path}) anywhere",
                )
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, f"{what}: {path}: too many levels of symlinks")
            target = os.readlink(at)
            if target.startswith("/"):
                done = []
            todo[:0] = [p for p in target.split("/") if p]
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(what, at, "not a directory", "choose a directory")
        _check_trusted_dir(st, at, path if todo else at, what)
        done.append(part)
    return "/" + "/".join(done), st


def check_root_dir(path: os.PathLike[str] | str, what: str) -> os.stat_result:
    """``path`` must be a directory we may keep a tier in (see the module docstring: it
    and every directory above it owned by us or root and writable by group or others
    only if sticky, every symlink on the way owned by us or root); its ``stat``, or
    ``PermissionError`` saying which directory is wrong and how to fix it."""
    _, st = _resolve_checked(os.path.abspath(path), what)
    return st


def open_root_dir(path: os.PathLike[str] | str, what: str, create: bool = False) -> int:
    """:func:`check_root_dir`, then open the directory checked: a file descriptor to
    work relative to from now on (the caller closes it). ``create``: make the
    directories missing (mode 0700), each once the directory above it passed the checks
    (nothing is made under one that fails them). ``PermissionError`` if the directory
    opened is not the one checked (a rename in between)."""
    text = os.path.abspath(path)
    resolved, st = _resolve_checked(text, what, create)
    fd = os.open(resolved, _DIR_FLAGS | getattr(os, "O_NOFOLLOW", 0))
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _refuse(
                what, text, "it changed while it was checked", "check who else renames it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_private_dir(
    path: os.PathLike[str] | str, what: str, dir_fd: int | None = None
) -> os.stat_result:
    """Create the directory ``path`` (mode 0700; relative to ``dir_fd`` if given) unless
    it exists, then :func:`check_private_dir` it: one that another user made first is
    refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    return check_private_dir(path, what, dir_fd=dir_fd)


def open_private_dir(name: str, what: str, dir_fd: int, shown: Path | str) -> int:
    """Create the directory ``name`` in the directory ``dir_fd`` (mode 0700) unless it
    exists, check it as :func:`make_private_dir` does (``shown``: its path, for the
    messages) and open it without following a symlink: a file descriptor the caller
    closes."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    _check_private_dir_stat(st, shown, what)
    fd = os.open(name, _DIR_FLAGS | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _refuse(what, shown, "it changed while it was checked", "check who renames it")
    except BaseException:
        os.close(fd)
        raise
    return fd
