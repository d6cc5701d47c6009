"""Requests looked up key by key, told to a policy that observes requests.

A caller that walks a prompt with ``lookup`` (one key at a time) instead of
``lookup_prefix`` still tells the manager of a request, and ``auto`` must hear of it:
:class:`Walks` keeps the keys of the open walk (a call of another kind, or a key looked
up again, ends it) and tells the policy of the request once, at a ``touch``, before the
touch: the keys of the walk and those the touch adds. That is the first touch that
reaches the walk's first key not ready (the store's touch of the keys after the hits),
or the first touch of a walk that found every key ready. A walk that no such touch
follows is heard at the next ``touch`` or ``lookup_prefix``, before that call's own
request. A lookup never changes the policy, and a refused store changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncoffload.keys import OffloadKey

__all__ = ["MAX_UNHEARD", "Walks"]

#: Walks set aside unheard that a manager keeps.
MAX_UNHEARD = 64


class Walks:
    """The walks of one manager; ``on_request`` tells its policy of a request (``None``:
    the policy hears no requests, or hears them otherwise, and every call is a no-op).

    It keeps the open walk (each key with its position), where its first key not ready
    is, whether a call of another kind ended it, and walks ended before a touch heard
    them (the newest :data:`MAX_UNHEARD`)."""

    __slots__ = ("_on_request", "ended", "keys", "miss", "unheard")

    def __init__(self, on_request: Callable[[list[OffloadKey]], object] | None) -> None:
        self._on_request = on_request
        self.keys: dict[OffloadKey, int] = {}
        #: Position of the walk's first key not ready (-1: every key so far was).
        self.miss = -1
        self.ended = False
        self.unheard: list[list[OffloadKey]] = []

    def __bool__(self) -> bool:
        return bool(self.keys or self.unheard)

    def look(self, key: OffloadKey, ready: bool) -> None:
        """``lookup`` of ``key``: it joins the open walk, or starts the next one."""
        if self._on_request is None:
            return
        if self.keys and (self.ended or key in self.keys):
            self._set_aside()
        elif not self.keys:
            self.ended = False  # a call of another kind before any lookup
        keys = self.keys
        if not ready and self.miss < 0:
            self.miss = len(keys)
        keys[key] = len(keys)

    def end(self) -> None:
        """A call of another kind (a load, a store): a key looked up next starts another
        request."""
        if self._on_request is not None:
            self.ended = True

    def _set_aside(self) -> None:
        """The open walk's request went by unheard: heard at the next touch."""
        unheard = self.unheard
        unheard.append(list(self.keys))
        if len(unheard) > MAX_UNHEARD:
            del unheard[0]
        self._reset()

    def _reset(self) -> None:
        self.keys = {}
        self.miss = -1
        self.ended = False

    def touched(self, touched: Sequence[OffloadKey]) -> None:
        """Tell the policy of the requests a touch of ``touched`` tells of, oldest first:
        the walks set aside, then the open walk (with the keys the touch adds) where the
        touch reaches its first key not ready, or it found every key ready; else the walk
        ends."""
        on_request = self._on_request
        if on_request is None or not self or not touched:
            return
        heard, self.unheard = self.unheard, []
        keys, miss = self.keys, self.miss
        if keys:
            if miss < 0 or any(keys.get(key, miss) >= miss for key in touched):
                heard.append(list(keys) + [key for key in touched if key not in keys])
                self._reset()
            else:
                self.ended = True
        for request in heard:
            on_request(request)

    def prefix_lookup(self) -> None:
        """A ``lookup_prefix`` tells of its request: the policy hears of the walks set
        aside first; the open walk, of the same request, is dropped."""
        if self._on_request is None or not self:
            return
        heard, self.unheard = self.unheard, []
        self._reset()
        for request in heard:
            self._on_request(request)

    def clear(self) -> None:
        """Forget every walk (the cache was reset)."""
        self.unheard = []
        self._reset()
