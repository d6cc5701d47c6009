"""The demo's settings: :class:`DemoConfig`, checked as a whole and against the machine.

:class:`DemoConfigError` is a setting that does not fit, found once the workload is known
(the command line reports it as an option error).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncoffload.config import EngineConfig, byte_setting
from asyncoffload.hostmem import available_host_bytes, format_bytes
from asyncoffload.integrations import check_endpoint, shift_tcp_port
from asyncoffload.tiers.mooncake import MooncakeTier
from asyncoffload.tiers.remote import RemoteTier
from asyncoffload.tiers.settings import known_policy
from asyncoffload.workloads import Request, synthetic_chat

__all__ = ["DemoConfig", "DemoConfigError"]


class DemoConfigError(ValueError):
    """The settings do not fit together (found once the workload is known)."""


class DemoConfig(BaseModel):
    """Settings of :func:`run_demo`. The defaults finish in well under a minute."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Workload (see synthetic_chat).
    requests: int = Field(1500, ge=1, description="Requests in the workload.")
    system_prompts: int = Field(4, ge=1, description="Distinct system prompts.")
    system_prompt_blocks: int = Field(32, ge=0, description="Blocks of each system prompt.")
    turns: int = Field(5, ge=1, description="Turns per chat session.")
    blocks_per_turn: float = Field(6.0, gt=0, description="Mean user message, in blocks.")
    output_tokens: float = Field(128.0, gt=0, description="Mean reply length, in tokens.")
    arrival_rate: float = Field(150.0, gt=0, description="Requests per workload second.")
    think_time_s: float = Field(1.0, ge=0, description="Mean gap between turns of a session.")
    seed: int = Field(
        0,
        description="Seed of the workload and the block contents: any int (the contents "
        "take it modulo 2**64).",
    )
    # The engine.
    cpu_blocks: int = Field(4096, gt=0, description="Slots of the CPU tier.")
    policy: str = Field(
        EngineConfig.model_fields["policy"].default,
        description="Cache policy of the CPU tier (default: the engine's).",
    )
    completion: Literal["auto", "eventfd", "poll"] = "auto"
    event_buffer: int = Field(1 << 16, gt=0, description="The subscriber's event buffer.")
    disk_path: Path | None = Field(
        None,
        description="A disk tier below the CPU tier, its files in this directory (a "
        "slab, unlinked once open); None: no disk tier.",
    )
    disk_bytes: int = Field(
        2 << 30,
        gt=0,
        description="Capacity of the disk tier, bytes (or '2GiB'). The tier is inclusive: "
        "it must be larger than the CPU tier to add hits.",
    )
    remote_url: str | None = Field(
        None,
        description="A shared tier on Redis / Valkey at this URL (redis://host:port/db), "
        "below the CPU tier and the disk tier; every stored block is written to it, and "
        "prompts are looked up there first. None: no shared tier.",
    )
    mooncake_master: str | None = Field(
        None,
        description="A shared tier on Mooncake Store, its master at this host:port, below "
        "the CPU tier, the disk tier and the Redis / Valkey tier; every stored block is "
        "written to it, and prompts are looked up there first. None: no Mooncake tier.",
    )
    # The simulated model and server.
    layers: int = Field(8, ge=1, description="KV layers.")
    block_size: int = Field(16, ge=1, description="Tokens per block.")
    kv_heads: int = Field(4, ge=1)
    head_dim: int = Field(64, ge=1)
    gpu_blocks: int | None = Field(
        None,
        ge=1,
        description="Blocks of the simulated GPU KV cache (default: enough "
        "for `concurrency` of the largest request).",
    )
    concurrency: int = Field(16, ge=1, description="Requests served at once.")
    settle: bool = Field(
        False,
        description="Each request first waits until the copies and the tiers' writes in "
        "flight end (engine.flush()): with concurrency 1, hit rates then depend on the "
        "workload alone, not on how fast the machine is. For tests and comparisons: a "
        "server does not wait so.",
    )
    time_scale: float = Field(
        1.0,
        ge=0,
        description="Wall seconds per workload second (arrivals and compute); "
        "0 runs as fast as possible.",
    )
    torch_threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op threads while the demo runs (the copy threads "
        "and the checks already run in parallel); None leaves torch's setting.",
    )
    prefill_us_per_token: float = Field(20.0, ge=0, description="Compute per prompt token.")
    decode_us_per_token: float = Field(50.0, ge=0, description="Compute per output token.")
    # Integrations.
    publish: str | None = Field(
        None,
        description="Publish vLLM-compatible KV events on this ZMQ endpoint while the "
        "demo runs (needs asyncoffload[events]).",
    )
    publish_replay: str | None = Field(
        None,
        description="The replay (ROUTER) endpoint; default: the publish port + 1 for a "
        "tcp endpoint, none otherwise.",
    )
    publish_topic: str = Field("", description="Topic frame of the published batches.")
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on 127.0.0.1:PORT while the demo runs "
        "(0: any free port; needs asyncoffload[prometheus]).",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        return known_policy(value)

    @field_validator("disk_bytes", mode="before")
    @classmethod
    def _byte_size(cls, value: object) -> object:
        return byte_setting(value, "disk_bytes")

    @field_validator("remote_url")
    @classmethod
    def _remote_url(cls, value: str | None) -> str | None:
        if value is not None:
            RemoteTier(value)  # its own checks (the scheme)
        return value

    @field_validator("mooncake_master")
    @classmethod
    def _mooncake_master(cls, value: str | None) -> str | None:
        if value is not None:
            MooncakeTier(value)  # its own checks (host:port)
        return value

    @field_validator("publish", "publish_replay")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_endpoint(value)
        port = value.rpartition(":")[2]
        # ZeroMQ binds a port above 65535 as another one (modulo 2**16), silently.
        if value.startswith("tcp://") and port.isdigit() and int(port) > 65535:
            raise ValueError(f"endpoint {value!r}: port {port} is not a TCP port (0 to 65535)")
        return value

    @model_validator(mode="after")
    def _whole_words(self) -> DemoConfig:
        if (self.block_size * self.kv_heads * self.head_dim * 2) % 8:
            raise ValueError(
                "block_size * kv_heads * head_dim must be a multiple of 4 "
                "(a block fragment is checked as int64 words)"
            )
        return self

    @property
    def replay_endpoint(self) -> str | None:
        """Where the publisher answers replay requests (None: no replay socket)."""
        if self.publish is None:
            return None
        if self.publish_replay is not None:
            return self.publish_replay
        return shift_tcp_port(self.publish, 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (one CPU slot)."""
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * 2

    def workload(self) -> list[Request]:
        return synthetic_chat(
            self.requests,
            num_system_prompts=self.system_prompts,
            system_prompt_blocks=self.system_prompt_blocks,
            turns=self.turns,
            blocks_per_turn=self.blocks_per_turn,
            output_tokens=self.output_tokens,
            block_size=self.block_size,
            arrival_rate=self.arrival_rate,
            think_time_s=self.think_time_s,
            seed=self.seed,
        )


#: Lower bounds of what generating the workload holds in memory (CPython, 64 bits): a
#: generated token (a list slot and an int object), a key in a request's prompt (a
#: tuple slot), and a request (its object, ids and tuple), a system prompt's lists.
_TOKEN_BYTES = 36
_KEY_REF_BYTES = 8
_REQUEST_BYTES = 300
_PROMPT_BYTES = 200


def _check_workload_size(cfg: DemoConfig) -> None:
    """Refuse, before generating anything, a workload whose generation would take more
    memory than the machine has (it would allocate until ``MemoryError``, or longer):
    :class:`DemoConfigError` naming the options of the largest part and both sizes.

    The figures are lower bounds: the whole system prompts, one session's tokens (a
    session is generated whole, every turn) and the prompts of at least
    ``requests / turns`` whole sessions (they are cut to ``requests`` at the end)."""
    big = 1e300  # ints of any size, as floats that cannot overflow

    def f(x: float) -> float:
        return min(float(min(x, 10**300)) if isinstance(x, int) else x, big)

    bs, turns = f(cfg.block_size), f(cfg.turns)
    user, reply = f(cfg.blocks_per_turn), f(cfg.output_tokens) / bs
    system = f(cfg.system_prompt_blocks)
    sessions = max(1.0, math.ceil(f(cfg.requests) / turns))
    keys = turns * system + user * turns * (turns + 1) / 2 + reply * turns * (turns - 1) / 2
    parts = {
        f"--requests {cfg.requests} in sessions of --turns {cfg.turns} (their prompts: "
        f"--blocks-per-turn {cfg.blocks_per_turn:g}, --system-prompt-blocks "
        f"{cfg.system_prompt_blocks})": sessions * (keys * _KEY_REF_BYTES + turns * _REQUEST_BYTES),
        f"--turns {cfg.turns} of --blocks-per-turn {cfg.blocks_per_turn:g} (one session's "
        "tokens)": (turns * user + (turns - 1) * reply) * bs * _TOKEN_BYTES,
        f"--system-prompts {cfg.system_prompts} of --system-prompt-blocks "
        f"{cfg.system_prompt_blocks}": f(cfg.system_prompts)
        * (system * bs * _TOKEN_BYTES + _PROMPT_BYTES),
    }
    need = min(sum(parts.values()), big)
    available = available_host_bytes()
    if available is None or need <= available:
        return
    largest = max(parts, key=lambda k: parts[k])
    shown = format_bytes(min(need, 1 << 60))
    raise DemoConfigError(
        f"{largest}: generating the workload needs at least {shown} of host memory; this "
        f"machine has {format_bytes(available)} available"
    )
