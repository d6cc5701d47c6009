"""A KV-aware router's view of one server: which blocks each tier holds, from KV events.

Subscribes to a server's KV events (vLLM's wire format: asyncoffload's
``KVEventPublisher`` or vLLM itself), keeps a per-tier index of the blocks it holds,
and fills gaps in the sequence numbers through the replay socket. Run it beside the
demo:

    python -m asyncoffload demo --publish tcp://127.0.0.1:5557 --requests 20000 &
    python examples/kv_index.py --endpoint tcp://127.0.0.1:5557 \
        --replay-endpoint tcp://127.0.0.1:5558

It needs only pyzmq and msgspec: the wire classes below mirror vLLM's
(``vllm/distributed/kv_events.py``), they are not imported from asyncoffload.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any, TextIO

import msgspec
import zmq

# --- vLLM's wire classes (positional arrays, tagged by class name) -----------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = -1
Block = tuple[bytes | int, int]  # (block hash, group index)


class KVIndex:
    """The blocks each tier ("GPU", "CPU", ...) of one server holds."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[Block]] = defaultdict(set)
        #: Token ids of blocks whose BlockStored described them.
        self.tokens: dict[Block, list[int]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.tiers.clear()
                self.tokens.clear()
            elif isinstance(event, BlockStored):
                tier = self.tiers[event.medium or "GPU"]
                group = event.group_idx or 0
                size = event.block_size
                for i, h in enumerate(event.block_hashes):
                    tier.add((h, group))
                    if event.token_ids and size:
                        self.tokens[h, group] = event.token_ids[i * size : (i + 1) * size]
            else:
                tier = self.tiers[event.medium or "GPU"]
                group = event.group_idx or 0
                for h in event.block_hashes:
                    tier.discard((h, group))
                    self.tokens.pop((h, group), None)

    def sizes(self) -> dict[str, int]:
        return {tier: len(blocks) for tier, blocks in sorted(self.tiers.items()) if blocks}


class Subscriber:
    """Feeds a :class:`KVIndex` from a PUB socket, replaying what it missed.

    On :meth:`connect` it asks the replay socket for everything after the last batch it
    applied (from 0 the first time: the whole history the server still buffers), and
    whenever a batch arrives with a sequence number past the next expected, it fills
    the gap the same way. Gaps the server no longer buffers are counted in ``lost``.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        index: KVIndex | None = None,
        context: zmq.Context[Any] | None = None,
        replay_timeout_ms: int = 2000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index if index is not None else KVIndex()
        self.ctx: zmq.Context[Any] = context if context is not None else zmq.Context.instance()
        self.replay_timeout_ms = replay_timeout_ms
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sub: zmq.Socket[bytes] | None = None
        self.last_seq = -1
        self.applied = self.replayed = self.lost = 0

    def connect(self, wait_s: float = 0.0, log: TextIO | None = None) -> None:
        """Subscribe, then catch up through the replay socket. A server that is not up
        yet (started a moment ago, say) is waited for, up to ``wait_s`` seconds, asking
        again every ``replay_timeout_ms``; ``log`` (if given) is told once what is awaited.
        Past the bound, ``TimeoutError`` names the endpoint."""
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                self.replay(self.last_seq + 1)
                return
            except (TimeoutError, ConnectionError):
                if time.monotonic() >= deadline:
                    raise
                if log is not None and not told:
                    told = True
                    print(
                        f"waiting up to {wait_s:g} s for the server's replay socket at "
                        f"{self.replay_endpoint} (is the server started?)",
                        file=log,
                        flush=True,
                    )

    def disconnect(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
            self.sub = None

    def poll(self, timeout_ms: int = 100) -> int:
        """Apply the batches that arrive within ``timeout_ms``; how many were applied."""
        assert self.sub is not None, "connect() first"
        n = 0
        while self.sub.poll(timeout_ms):
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue  # already applied (from a replay)
            if seq > self.last_seq + 1:
                self.replay(self.last_seq + 1)
                if seq <= self.last_seq:
                    continue
                if seq > self.last_seq + 1:  # the server no longer had the gap
                    self.lost += seq - self.last_seq - 1
            self._apply(seq, payload)
            n += 1
            timeout_ms = 0
        return n

    def replay(self, start: int) -> None:
        """Apply every buffered batch from ``start`` on."""
        if self.replay_endpoint is None:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(self.replay_timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 3 or frames[0] or len(frames[1]) != 8:
                    # Not the server's replay socket: something else on that port, or,
                    # before the server binds a port in the kernel's ephemeral range, this
                    # socket connected to itself (it reads back its own request).
                    raise ConnectionError(
                        f"the replay socket at {self.replay_endpoint} answered "
                        f"{len(frames)} frames, not [empty, seq, payload]"
                    )
                _empty, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    if payload:
                        raise RuntimeError(f"replay refused: {payload.decode()}")
                    return
                if seq == self.last_seq + 1:
                    self._apply(seq, payload)
                    self.replayed += 1
                elif seq > self.last_seq + 1:  # the server's buffer starts after our gap
                    self.lost += seq - self.last_seq - 1
                    self._apply(seq, payload)
                    self.replayed += 1
            raise TimeoutError(
                f"no answer from the replay socket at {self.replay_endpoint} "
                f"within {self.replay_timeout_ms} ms"
            )
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.index.apply(self.decoder.decode(payload))
        self.last_seq = seq
        self.applied += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558")
    ap.add_argument("--topic", default="")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    ap.add_argument(
        "--wait",
        type=float,
        default=60,
        help="seconds to wait for a server that is not up yet (default 60)",
    )
    args = ap.parse_args()
    sub = Subscriber(args.endpoint, args.replay_endpoint or None, args.topic)
    try:
        sub.connect(wait_s=args.wait, log=sys.stderr)
    except TimeoutError as exc:
        sub.disconnect()
        raise SystemExit(f"kv_index: {exc} after waiting {args.wait:g} s") from None
    t0 = last = time.monotonic()
    try:
        while not args.seconds or time.monotonic() - t0 < args.seconds:
            sub.poll(200)
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                print(
                    f"seq {sub.last_seq}: {sub.index.sizes()} "
                    f"({sub.replayed} batches replayed, {sub.lost} lost)",
                    flush=True,
                )
    except KeyboardInterrupt:
        pass
    finally:
        sub.disconnect()
    print(
        f"final: seq {sub.last_seq}, {sub.index.sizes()}, {sub.replayed} replayed, {sub.lost} lost"
    )


if __name__ == "__main__":
    main()
