"""Whom a directory or file we keep blocks in can be written by: the checks of the disk
tier's directories and of the shared host pool file, after OpenSSH's ``StrictModes`` and
PostgreSQL's data directory check.

Blocks encode users' prompts and are read back into the KV cache, so whoever can write
where they live can plant a forged block or read others'. Three kinds of path:

- **Private** (the namespace directory, its 2-hex subdirectories, a host pool file): a
  real directory (or a regular file), never a symlink, owned by this process's effective
  uid, not writable by group or others.
- **The tier's root** (``DiskTier.path``, the host pool's directory): owned by us or by
  root, and writable by group or others only if sticky (``/tmp``, ``/dev/shm``: another
  user may add entries but not rename or remove ours). It may be reached through a
  symlink owned by us or by root.
- **Its ancestors**: not writable by others unless sticky (whoever can rename an ancestor
  can swap the whole tree). Their owners are trusted as the administrator who made them.

Each refusal is a ``PermissionError`` naming the path and what is wrong (owner uid
against ours, mode bits), and how to fix it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

__all__ = [
    "check_private_dir",
    "check_private_file",
    "check_root_dir",
    "make_private_dir",
]

_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner_problem(st: os.stat_result, allow_root: bool) -> str | None:
    uid = os.geteuid()
    if st.st_uid == uid or (allow_root and st.st_uid == 0):
        return None
    whom = f"this process's uid {uid}" + (" or root" if allow_root and uid != 0 else "")
    return f"owned by uid {st.st_uid}, not by {whom}"


def _refuse(what: str, path: os.PathLike[str] | str, problem: str, fix: str) -> PermissionError:
    return PermissionError(f"{what}: refusing {os.fspath(path)}: {problem}; {fix}")


def check_private_dir(path: os.PathLike[str] | str, what: str) -> os.stat_result:
    """``path`` (not followed if a symlink) must be a directory owned by us and not
    writable by group or others; its ``lstat``, or ``PermissionError`` saying why not."""
    st = os.lstat(path)
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
    return st


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


def _shared_ok(st: os.stat_result) -> bool:
    return not st.st_mode & stat.S_IWOTH or bool(st.st_mode & stat.S_ISVTX)


def check_root_dir(path: os.PathLike[str] | str, what: str) -> None:
    """``path`` must be a directory we may keep a tier in (see the module docstring:
    owned by us or root, writable by others only if sticky, a symlink to it owned by us
    or root), and no ancestor of it (as given and as resolved) may be writable by others
    without being sticky. ``PermissionError`` saying why not."""
    path = Path(os.path.abspath(path))
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode):
        owner = _owner_problem(link, allow_root=True)
        if owner is not None:
            raise _refuse(what, path, f"a symlink {owner}", "it could lead anywhere")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, path, "not a directory", "choose a directory")
    owner = _owner_problem(st, allow_root=True)
    if owner is not None:
        raise _refuse(what, path, owner, "its owner could replace what the tier keeps there")
    if st.st_mode & _GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            what,
            path,
            f"writable by group or others and not sticky (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod go-w {path} (or o+t, as /tmp)",
        )
    seen: set[Path] = set()
    for parent in [*path.parents, *Path(os.path.realpath(path)).parents]:
        if parent in seen:
            continue
        seen.add(parent)
        pst = os.stat(parent)
        if not _shared_ok(pst):
            raise _refuse(
                what,
                parent,
                "writable by others and not sticky "
                f"(mode {stat.S_IMODE(pst.st_mode):04o}): anyone could swap {path}",
                f"chmod o-w {parent} (or o+t, as /tmp)",
            )


def make_private_dir(path: os.PathLike[str] | str, what: str) -> os.stat_result:
    """Create the directory ``path`` (mode 0700) unless it exists, then
    :func:`check_private_dir` it: one that another user made first is refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return check_private_dir(path, what)
