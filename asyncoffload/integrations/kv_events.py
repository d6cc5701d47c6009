"""vLLM-compatible KV events over ZMQ (work in progress: the statistics record first)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PublisherStats"]


class PublisherStats(NamedTuple):
    """Counters of a :class:`KVEventPublisher`, from its start."""

    #: Batches sent on the PUB socket, and the wire events (BlockStored, BlockRemoved,
    #: AllBlocksCleared) in them.
    batches_published: int
    events_published: int
    #: Engine events the publisher lost: its subscription overflowed, or a send failed.
    #: Each loss is followed by a resync (AllBlocksCleared, then a snapshot).
    events_dropped: int
    resyncs: int
    #: Replay requests answered, those refused as malformed, batches sent in replies.
    replay_requests: int
    replay_errors: int
    batches_replayed: int
    #: Sequence number of the last batch published (-1 before the first).
    last_seq: int
    #: Batches held for replay.
    replay_buffered: int
    #: Engine events waiting in the publisher's subscription.
    lag: int
