"""Host slots in a shared-memory file: :class:`SharedHostFile`, the host pool a paged
engine (the worker side of a serving engine) keeps its slots in when another process
(the scheduler side, which moves slots to and from a disk tier) must map them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import secrets
import struct
import time
import weakref

import torch

from asyncoffload._ownership import check_private_file, open_root_dir
from asyncoffload.transfer.base import HostRegion

__all__ = ["HOST_FILE_WAIT_S", "SharedHostFile"]

#: The header page of a :class:`SharedHostFile`: magic, version, header bytes, slot bytes,
#: slots, the creator's pid. The slots follow it, so slot 0 is page-aligned.
_HOST_FILE_MAGIC = b"AOHPOOL\x00"
_HOST_FILE_VERSION = 1
_HOST_FILE_HEADER = 4096
_HOST_FILE_STRUCT = struct.Struct("<8sIIQQQ")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class SharedHostFile:
    """Host slots in a shared-memory file (``/dev/shm`` or any directory), mapped
    ``MAP_SHARED`` by the process that made it (:meth:`create`, a worker) and by others
    (:meth:`open`, the scheduler side) at once.

    Layout: a 4096-byte header page (magic ``AOHPOOL\\0``, version, header bytes, slot
    bytes, number of slots, the creator's pid), then ``num_slots`` slots of
    ``slot_bytes``, back to back: slot ``i`` starts at ``4096 + i * slot_bytes``, so
    slots are 4096-aligned whenever ``slot_bytes`` is a multiple of 4096. The file is
    mode 0600 and appears whole: it is made under a temporary name, sized, given its
    header, and renamed to ``path``. The creator unlinks it at :meth:`close` (and when
    collected); an opener may unlink it once it has mapped it (``unlink=True``), so that
    a crash of both leaves nothing behind. Mappings outlive the name.

    Its directory must be owned by us or root and, if others may write it, sticky
    (``/dev/shm``); an opener maps only a regular file owned by its own uid and not
    writable by group or others (``PermissionError`` naming the path otherwise: another
    user could read or forge the KV blocks in it).
    """

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        num_slots: int,
        slot_bytes: int,
        owner: bool,
        creator_pid: int | None = None,
    ) -> None:
        self.path = path
        #: The pid of the process that made the file (from its header).
        self.creator_pid = os.getpid() if creator_pid is None else creator_pid
        self.map: mmap.mmap | None = mm
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.owner = owner
        #: The file, kept open by ``open(keep_fd=True)``; else -1.
        self.fd = -1
        # Unlinks the name (the creator's), not the memory: views of the map go with
        # their last reference.
        self._finalizer = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @staticmethod
    def file_bytes(num_slots: int, slot_bytes: int) -> int:
        return _HOST_FILE_HEADER + _round_up(num_slots * slot_bytes, mmap.PAGESIZE)

    @classmethod
    def create(
        cls, path: str | os.PathLike[str], num_slots: int, slot_bytes: int
    ) -> SharedHostFile:
        """Make the file at ``path`` (replacing a stale one) and map it. ``OSError``
        (``ENOSPC`` naming the sizes) where its directory has too little room;
        ``PermissionError`` where others could replace it (see the class docstring) or
        another user's file holds the name."""
        path = os.fspath(path)
        size = cls.file_bytes(num_slots, slot_bytes)
        folder = os.path.dirname(path) or "."
        dir_fd = open_root_dir(folder, "shared host pool")
        try:
            return cls._create(path, folder, dir_fd, num_slots, slot_bytes, size)
        finally:
            os.close(dir_fd)

    @classmethod
    def _create(
        cls, path: str, folder: str, dir_fd: int, num_slots: int, slot_bytes: int, size: int
    ) -> SharedHostFile:
        try:
            st = os.fstatvfs(dir_fd)
        except OSError:
            pass
        else:
            if st.f_bavail * st.f_frsize < size:
                raise OSError(
                    errno.ENOSPC,
                    f"{folder} has {st.f_bavail * st.f_frsize} bytes free, too few for a "
                    f"{size}-byte shared host pool ({num_slots} slots of {slot_bytes} B)",
                )
        name = os.path.basename(path)
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            os.ftruncate(fd, size)
            header = _HOST_FILE_STRUCT.pack(
                _HOST_FILE_MAGIC,
                _HOST_FILE_VERSION,
                _HOST_FILE_HEADER,
                slot_bytes,
                num_slots,
                os.getpid(),
            )
            os.pwrite(fd, header, 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except PermissionError:  # a sticky directory: another user's file has the name
                owner = "?"
                with contextlib.suppress(OSError):
                    owner = str(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid)
                raise PermissionError(
                    f"shared host pool: cannot replace {path}, owned by uid {owner} (this "
                    f"process's uid is {os.geteuid()}): remove it, or set another directory"
                ) from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
        return cls(path, mm, num_slots, slot_bytes, owner=True)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        num_slots: int,
        slot_bytes: int,
        *,
        unlink: bool = False,
        keep_fd: bool = False,
    ) -> SharedHostFile:
        """Map the file a creator made at ``path``. ``FileNotFoundError`` while it does
        not exist yet; ``ValueError`` if it is not a host pool of ``num_slots`` slots of
        ``slot_bytes``; ``PermissionError`` naming the path if it is no regular file of
        ours, or group or others may write it. ``unlink``: remove the name once mapped.
        ``keep_fd``: keep the checked file open as :attr:`fd` (for another process to
        map: :meth:`region`), closed with the map."""
        path = os.fspath(path)
        fd = os.open(
            path,
            os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
        )
        try:
            size = check_private_file(fd, path, "shared host pool").st_size
            raw = os.pread(fd, _HOST_FILE_STRUCT.size, 0)
            if len(raw) < _HOST_FILE_STRUCT.size:
                raise ValueError(f"{path} is not a host pool file (too short)")
            magic, version, header, slots_b, slots_n, pid = _HOST_FILE_STRUCT.unpack(raw)
            if magic != _HOST_FILE_MAGIC or version != _HOST_FILE_VERSION:
                raise ValueError(f"{path} is not a host pool file (magic or version)")
            if header != _HOST_FILE_HEADER or (slots_b, slots_n) != (slot_bytes, num_slots):
                raise ValueError(
                    f"{path} holds {slots_n} slots of {slots_b} B; expected {num_slots} "
                    f"slots of {slot_bytes} B"
                )
            want = cls.file_bytes(num_slots, slot_bytes)
            if size < want:
                raise ValueError(f"{path} has {size} bytes, fewer than {want}")
            mm = mmap.mmap(fd, want, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        if unlink:
            _unlink_quietly(path)
        shared = cls(path, mm, num_slots, slot_bytes, owner=False, creator_pid=pid)
        shared.fd = fd
        return shared

    @classmethod
    def wait_open(
        cls, path: str | os.PathLike[str], num_slots: int, slot_bytes: int, timeout_s: float
    ) -> SharedHostFile:
        """:meth:`open` the file another process makes at ``path``, waiting for it (and
        past a stale one, whose creator is gone) for at most ``timeout_s``:
        ``TimeoutError`` naming the path then; ``ValueError`` at once for a file of
        other sizes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                shared = cls.open(path, num_slots, slot_bytes)
            except FileNotFoundError:
                pass
            else:
                if shared.creator_alive():
                    return shared
                shared.close()  # a dead creator's: the live one replaces it
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no shared host pool at {os.fspath(path)} after {timeout_s:.0f}s (the "
                    "process that makes it, the first worker, did not start?)"
                )
            time.sleep(0.01)

    def creator_alive(self) -> bool:
        """Whether the process that made the file still runs (a file whose creator is
        gone is stale: a new one replaces it)."""
        try:
            os.kill(self.creator_pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process (EPERM): it exists
            return True
        return True

    def tensor(self) -> torch.Tensor:
        """The slots as a ``[num_slots, slot_bytes]`` uint8 tensor viewing the map."""
        assert self.map is not None, "the host file is closed"
        return torch.frombuffer(
            self.map,
            dtype=torch.uint8,
            offset=_HOST_FILE_HEADER,
            count=self.num_slots * self.slot_bytes,
        ).view(self.num_slots, self.slot_bytes)

    def close(self) -> None:
        """Unlink the name (the creator) and unmap; a view still alive keeps the memory
        until it goes. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        mm, self.map = self.map, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # a live view: unmapped with it
                mm.close()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def region(self) -> HostRegion:
        """The whole file as another process maps it (``open(keep_fd=True)`` only)."""
        if self.fd < 0 or self.map is None:
            raise ValueError(f"{self.path}: not kept open to be shared (keep_fd=False)")
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        return HostRegion(self.fd, address, len(self.map))

    def __repr__(self) -> str:
        return (
            f"<SharedHostFile {self.path} {self.num_slots} slots of {self.slot_bytes} B"
            f"{' (creator)' if self.owner else ''}{' closed' if self.map is None else ''}>"
        )


#: How long a worker that maps another's host pool (``host_file_owner=False``) waits
#: for it to appear.
HOST_FILE_WAIT_S = 120.0


def _host_file(
    path: str | os.PathLike[str], num_slots: int, slot_bytes: int, owner: bool
) -> SharedHostFile:
    """The host pool file at ``path``: made here (``owner``), or made by another process
    and mapped here (waiting for it up to :data:`HOST_FILE_WAIT_S`)."""
    if owner:
        return SharedHostFile.create(path, num_slots, slot_bytes)
    return SharedHostFile.wait_open(path, num_slots, slot_bytes, HOST_FILE_WAIT_S)
