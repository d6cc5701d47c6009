"""Engine configuration: validated once, at the boundary, never per call."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
)

from asyncoffload.manager.quotas import check_quota_table, resolve_quotas
from asyncoffload.manager.retention import DEFAULT_PIN_BUDGET, check_pin_budget
from asyncoffload.tiers.disk import DiskTier
from asyncoffload.tiers.settings import known_admission, known_policy
from asyncoffload.tiers.specs import TierSpec, tier_specs
from asyncoffload.transfer.settings import ENV_PREFIX, TransferSettings
from asyncoffload.validators import byte_setting, not_bool, parse_bytes

# known_admission, known_policy, byte_setting and parse_bytes were defined here first:
# they are still importable from here.
__all__ = ["EngineConfig", "byte_setting", "known_admission", "known_policy", "parse_bytes"]

CompletionMode = Literal["auto", "eventfd", "poll"]


#: The deadline settings of load_or_recompute, the engine's and vLLM's (pydantic copies a
#: field for each model it is declared in).
LOAD_DEADLINE_FACTOR: Any = Field(
    1.0,
    gt=0,
    le=100,
    allow_inf_nan=False,
    description="load_or_recompute: a promotion taken (and a question to a shared tier) is "
    "due by this many times the recompute time of its blocks; past it, the blocks are "
    "recomputed.",
)
LOAD_DEADLINE_FLOOR_S: Any = Field(
    0.05,
    ge=0,
    le=60,
    allow_inf_nan=False,
    description="load_or_recompute: the least time a promotion or a question is given (a "
    "driver's polling granularity, a tier's jitter), whatever the recompute time.",
)
LOAD_PROBE_EVERY_S: Any = Field(
    5.0,
    gt=0,
    le=3600,
    allow_inf_nan=False,
    description="load_or_recompute: a tier judged slower than recomputing is read again "
    "(one promotion it would decline, measured) at most this often, so that a tier that "
    "recovered is used again.",
)


class EngineConfig(BaseModel):
    """Settings of an :class:`~asyncoffload.AsyncOffloadEngine`.

    Every field can also come from the environment through :meth:`from_env`
    (``ASYNCOFFLOAD_CPU_BLOCKS=4096`` and so on).
    """

    # Validation errors never show their input: a tier's may hold its password or MAC key.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    cpu_blocks: int = Field(1024, gt=0, description="Slots of the CPU tier, one KV block each.")
    cpu_bytes: int | None = Field(
        None,
        description="Size of the CPU tier in bytes instead of cpu_blocks: an int or a string "
        "like '16GiB', '16 GB', '512MiB' (KB/MB/GB: powers of 1000; KiB/MiB/GiB: powers of "
        "1024). The engine resolves cpu_blocks = cpu_bytes // layout.block_bytes. Cannot be "
        "combined with an explicit cpu_blocks.",
    )
    policy: str = Field(
        "auto",
        description="Registered cache policy name: 'auto' (adaptive: follows the best of "
        "'lru', 'arc' and 'kv'), 'lru', 'arc', 'kv', 's3fifo', ...",
    )
    admission: str | None = Field(
        None,
        description="Registered admission filter ('ghost', 'adaptive') or None: store "
        "every offered block (store_threshold aside).",
    )
    store_threshold: int = Field(
        0, ge=0, description="Store a key only from its n-th offer (0 or 1: always store)."
    )
    pin_budget: float = Field(
        DEFAULT_PIN_BUDGET,
        description="The largest share of the CPU tier, in (0, 1], that retention pins "
        "(ReqContext.retention) may hold at once; a pin past it is refused and counted. "
        "Each lower tier has its own (DiskTier(pin_budget=...), ...).",
    )
    event_buffer: int = Field(
        4096, gt=0, description="Default per-subscription event buffer (events, not keys)."
    )
    completion: CompletionMode = Field(
        "auto",
        description="How the loop learns of finished copies: 'eventfd' wake-ups (a pipe "
        "where eventfd is missing), 'poll' on a timer, or 'auto' (eventfd where the loop "
        "supports add_reader, else poll).",
    )
    poll_interval_s: float = Field(
        0.001,
        ge=0.001,
        le=1.0,
        description="Timer period of the 'poll' completion mode, at least 1 ms: uvloop runs "
        "timers in whole milliseconds, truncated, so a shorter one fires at once and the "
        "loop spins (a benchmark's 0.5 ms poll held a CPU at 100 %).",
    )
    copy_engine: Literal["auto", "native", "threads"] = Field(
        "auto",
        description="CPU backend copy engine: 'native' lanes (compiled on first use, never "
        "take the GIL), 'threads' (Python threads), or 'auto' (native where it builds).",
    )
    inline_copy_bytes: int = Field(
        64 << 10,
        ge=0,
        description="CPU backend, native engine: a copy of at most this many bytes runs "
        "on the event loop's thread inside prepare_store / prepare_load, whose handle "
        "is then already resolved, when its lane is idle: the hop to a copy thread and "
        "back costs more than copying that much. 0: every copy goes to a copy thread.",
    )
    inline_wait_us: float = Field(
        100.0,
        ge=0,
        le=10_000,
        description="CUDA backend, native copy path: a copy that the bandwidth measured "
        "so far (and the copies queued before it) says ends within this many microseconds "
        "is waited for on the event loop's thread inside prepare_store / prepare_load, "
        "whose handle is then already resolved: the wake-up round trip costs more than "
        "that. The wait gives up at twice this; the copy then completes as usual. It "
        "blocks the loop while it waits. 0: never wait.",
    )
    copy_method: Literal["auto", "batch", "kernel", "staged", "gather"] = Field(
        "auto",
        description="CUDA backend copy method: 'kernel' (Triton SM copy through UVA), "
        "'batch' (cuMemcpyBatchAsync per fragment), 'staged' (kernel gather into device "
        "staging, then one DMA per block), 'gather' (torch gather + per-block copies), or "
        "'auto' (chosen per transfer by fragment size and count).",
    )
    pin_memory: bool = Field(True, description="Pin the CUDA backend's host pool.")
    staging_bytes: int = Field(
        192 << 20,
        gt=0,
        description="CUDA backend: device staging per buffer for the 'staged' and 'gather' "
        "methods, allocated on first use (staged: two buffers per direction, so 768 MiB "
        "of GPU memory at the default; 64 MiB buffers lost 6 points of two-direction "
        "bandwidth on an H100).",
    )
    host_chunk_bytes: int = Field(
        1 << 30, gt=0, description="The CUDA backend allocates its host pool in chunks of this."
    )
    touch_on_load: bool = Field(
        True, description="prepare_load marks the loaded keys recently used."
    )
    touch_on_store: bool = Field(
        True,
        description="prepare_store marks its keys used before storing them, so that with "
        "touch_on_load the policy sees every block of a request that loads its prefix "
        "and stores the rest (lookup, prepare_load, prepare_store). Turn both off when "
        "you call touch yourself.",
    )
    max_tracker_size: int = Field(
        64_000, gt=0, description="Keys whose offers store_threshold remembers."
    )
    tiers: list[TierSpec] = Field(
        default_factory=list,
        description="Tiers below the CPU tier, highest first: DiskTier(path, capacity, "
        "mode). Stores write through to them after the CPU copy; loads of keys found only "
        "there promote them (see docs/tiers.md). From the environment: a JSON list.",
    )
    model: str = Field(
        "",
        description="Names the model weights (path or hub id, with a revision): part of "
        "the identity of blocks in lower tiers. Required by files-mode disk tiers.",
    )
    tokens_per_block: int = Field(0, ge=0, description="Tokens per KV block (identity).")
    rank: int = Field(0, ge=0, description="Tensor-parallel rank of this KV shard (identity).")
    world_size: int = Field(1, gt=0, description="Tensor-parallel world size (identity).")
    tenant: str = Field(
        "",
        description="Tenant of this engine (a cache salt): lower-tier blocks of other "
        "tenants are never read. Per request: ReqContext.tenant.",
    )
    tenants: list[str] = Field(
        default_factory=list,
        description="The tenants (ReqContext.tenant) that quota tables may name.",
    )
    quotas: dict[str, int | str] = Field(
        default_factory=dict,
        description="Tenant quotas of the CPU tier, {tenant: quota}: blocks (an int), a "
        "share ('25%') or bytes ('512MiB', in KV blocks of the layout). Over its quota a "
        "tenant's store evicts its own blocks, never another's; what does not fit is "
        "refused and counted. Each tier of tiers takes its own quotas.",
    )
    load_or_recompute: bool = Field(
        True,
        description="Promote a block from a lower tier only when reading it is expected "
        "to beat recomputing it, and fall back to recompute (a failed load) when a read "
        "overruns a deadline derived from the recompute time (see docs/tiers.md, Load or "
        "recompute). False: every promotion is taken, under the tier's own deadline.",
    )
    recompute_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Prefill throughput of the serving engine (tokens per second), the "
        "recompute side of load_or_recompute; needs tokens_per_block. None: unknown, "
        "every promotion is taken (under the tier's own deadline).",
    )
    load_deadline_factor: float = LOAD_DEADLINE_FACTOR
    load_deadline_floor_s: float = LOAD_DEADLINE_FLOOR_S
    load_probe_every_s: float = LOAD_PROBE_EVERY_S
    log_summary_s: float | None = Field(
        None,
        gt=0,
        description="Log a one-line INFO summary (lookup hit rate, stores and loads with "
        "their GB/s, evictions, in flight) every this many seconds, from the engine's first "
        "use to aclose(); None: never.",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        return known_policy(value)

    @field_validator("pin_budget", mode="before")
    @classmethod
    def _pin_budget(cls, value: object) -> float:
        return check_pin_budget(value, "EngineConfig.pin_budget")

    @field_validator(
        "cpu_blocks",
        "store_threshold",
        "event_buffer",
        "staging_bytes",
        "host_chunk_bytes",
        "max_tracker_size",
        "inline_copy_bytes",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        return not_bool(value, "an integer")

    @field_validator("inline_wait_us", "poll_interval_s", mode="before")
    @classmethod
    def _not_a_bool_number(cls, value: object) -> object:
        return not_bool(value, "a number")

    @field_validator("cpu_bytes", mode="before")
    @classmethod
    def _byte_size(cls, value: object) -> object:
        return None if value is None else parse_bytes(value, "cpu_bytes")

    @model_validator(mode="after")
    def _one_capacity(self) -> EngineConfig:
        if self.cpu_bytes is not None and "cpu_blocks" in self.model_fields_set:
            raise ValueError(
                f"give either cpu_blocks ({self.cpu_blocks}) or cpu_bytes ({self.cpu_bytes}), "
                "not both"
            )
        return self

    def resolve_blocks(self, block_bytes: int) -> EngineConfig:
        """This config with ``cpu_blocks`` resolved from ``cpu_bytes`` for KV blocks of
        ``block_bytes`` each (itself when ``cpu_bytes`` is None); ``ValueError`` naming
        both sizes when not one block fits."""
        if self.cpu_bytes is None:
            return self
        blocks = self.cpu_bytes // block_bytes
        if blocks <= 0:
            raise ValueError(
                f"cpu_bytes={self.cpu_bytes} holds no KV block: one block takes {block_bytes} bytes"
            )
        # Already validated; model_copy keeps cpu_bytes (what was asked) next to the blocks.
        return self.model_copy(update={"cpu_blocks": blocks})

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers_json(cls, value: object) -> object:
        return tier_specs(value, "tiers: ")  # a JSON list from the environment

    @model_validator(mode="after")
    def _tier_identity(self) -> EngineConfig:
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, DiskTier) and tier.mode == "files" and not self.model:
                raise ValueError(
                    f"tiers[{i}] is a files-mode disk tier, whose blocks outlive the engine "
                    "and are shared: set model= to name the weights, so that another "
                    "model's blocks are never read"
                )
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.recompute_tokens_per_s is not None and self.tokens_per_block <= 0:
            raise ValueError(
                f"recompute_tokens_per_s={self.recompute_tokens_per_s} needs tokens_per_block "
                "(the tokens of one KV block) to tell a block's recompute time"
            )
        return self

    @model_validator(mode="after")
    def _quota_tables(self) -> EngineConfig:
        check_quota_table(self.quotas, self.tenants, "quotas")
        for i, tier in enumerate(self.tiers):
            check_quota_table(tier.quotas, self.tenants, f"tiers[{i}].quotas")
        if self.cpu_bytes is None:  # in blocks: a quota larger than the tier is known now
            resolve_quotas(self.quotas, self.cpu_blocks, 0, "quotas")
        return self

    @field_validator("admission", mode="before")
    @classmethod
    def _known_admission(cls, value: object) -> object:
        return known_admission(value)

    @model_validator(mode="after")
    def _one_admission_rule(self) -> EngineConfig:
        if self.admission is not None and self.store_threshold >= 2:
            raise ValueError("set either store_threshold or admission, not both")
        return self

    @classmethod
    def from_env(
        cls,
        prefix: str = "ASYNCOFFLOAD_",
        config_file: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> EngineConfig:
        """Fields from a config file, then ``{prefix}{FIELD}`` environment variables, then
        ``overrides`` (each wins over the one before), validated once.

        ``config_file`` (or, when it is None, the ``{prefix}CONFIG`` variable) names a TOML
        (``.toml``) or JSON file of field names and values; one that cannot be read (missing,
        not UTF-8, a syntax error, a number past Python's int-string limit, nested too
        deeply, not a table at the top) raises ``ValueError`` naming the file, and the line
        where the parser gives one, never its text. A ``{prefix}*`` variable that
        is neither a field nor one of the package's other variables, or an unknown key in
        the file, raises ``ValueError`` naming it (with the closest known name). Values
        that fail validation raise ``ValueError`` naming their variable or file and key:
        ``ASYNCOFFLOAD_CPU_BLOCKS='abc': Input should be a valid integer, ...``; a bad
        ``tiers`` value is named without being shown (a shared tier's password may be in
        it): ``ASYNCOFFLOAD_TIERS[0]['remote']['ttl_s']: Input should be greater than 0``.
        """
        return _from_sources(cls, prefix, config_file, overrides)


# --- configuration from the environment and a file (pydantic-settings) -------------------

#: ``ASYNCOFFLOAD_*`` variables the package reads elsewhere (suffixes after the prefix):
#: not EngineConfig fields, and not typos either.
OTHER_ENV_SUFFIXES = (
    "CONFIG",  # from_env's config file
    "LOG_LEVEL",  # asyncoffload.logs
    "NO_NATIVE",
    "CACHE_DIR",
    "COMPILE_TIMEOUT",
    "INSTALL_DIR",  # the native helpers' build
    # the copy paths: native copy, Triton kernels (checked by TransferSettings)
    *(name.upper() for name in TransferSettings.model_fields),
    "TRACE_DIR",
    "SOAK",
    "SIGINT_RUNS",
    "SGLANG",  # the test suite
)


#: Settings whose values may hold secrets (a shared tier's password, in its url or on
#: its own; a tier's ``mac_key``): an error names where they came from, never what they
#: were.
_SECRET_FIELDS = frozenset({"tiers"})


def _shown(key: str, value: object) -> str:
    """``=<value>`` for an error's "where", or nothing for a setting that may hold a
    secret."""
    return "" if key in _SECRET_FIELDS else f"={value!r}"


def _source_model(model: type[BaseModel]) -> type[BaseSettings]:
    """A settings class with ``model``'s field names, every one ``Any``: the sources hand
    over raw values (strings from the environment), which ``model`` then validates, so
    that each error can be traced to where its value came from."""
    fields: dict[str, Any] = {name: (Any, None) for name in model.model_fields}
    settings: type[BaseSettings] = create_model(
        f"_{model.__name__}Sources", __base__=BaseSettings, **fields
    )
    return settings


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


#: JSON's names for the types a config file's top level may hold instead of a table.
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _parse_file(path: Path) -> object:
    """The document in the TOML or JSON file ``path``. Every failure is a ``ValueError``
    naming the file, and the line where the parser gives one; none is chained, for a
    parser's error holds the file's text (``JSONDecodeError.doc``, a
    ``UnicodeDecodeError``'s bytes), where a tier's password may be."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ValueError(
            f"config file {path}: unknown format {suffix or '(no suffix)'!r}; "
            "use a .toml or a .json file"
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"config file {path}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, "
            f"column {column}"
        ) from None
    try:
        if suffix == ".toml":
            return _toml_loads(text)
        # An empty file is no settings, as an empty TOML file is.
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"config file {path}: {exc.msg} (at line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise ValueError(f"config file {path}: nested too deeply to read") from None
    except ValueError as exc:
        # TOMLDecodeError, whose message ends "(at line L, column C)", and a number past
        # Python's int-string conversion limit, of which the parsers say nothing more.
        raise ValueError(f"config file {path}: {exc}") from None


def _toml_loads(text: str) -> object:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)
    try:  # pragma: no cover - Python 3.10, where pydantic-settings needs tomli as well
        tomli = importlib.import_module("tomli")
    except ImportError:
        raise ValueError("reading TOML on Python 3.10 needs the tomli package") from None
    return tomli.loads(text)


def _read_file(
    settings: type[BaseSettings], path: Path, fields: Mapping[str, object]
) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {path}: no such file")
    document = _parse_file(path)
    if not isinstance(document, dict):
        found = _JSON_TYPES.get(type(document), type(document).__name__)
        raise ValueError(
            f"config file {path}: expected a table of settings at the top "
            f'(e.g. {{"cpu_bytes": "16GiB"}}), found {found}'
        )
    try:
        # pydantic-settings' matching of the file's keys to the fields (case-insensitive).
        data = InitSettingsSource(settings, document)()
    except Exception as exc:  # pragma: no cover - a parsed table of str keys always maps
        raise ValueError(f"config file {path}: {type(exc).__name__}: {exc}") from None
    for key in data:
        if key not in fields:
            hint = _suggest(key, list(fields))
            raise ValueError(
                f"config file {path}: unknown key {key!r}{hint}; known: {', '.join(fields)}"
            )
    return dict(data)


def _check_env_names(prefix: str, fields: Mapping[str, object]) -> dict[str, str]:
    """The environment's ``{prefix}*`` variables by field name; ``ValueError`` naming
    those that are neither fields nor the package's other variables."""
    if not prefix:
        return {}
    upper = prefix.upper()
    by_field = {upper + name.upper(): name for name in fields}
    others = {upper + suffix for suffix in OTHER_ENV_SUFFIXES}
    found: dict[str, str] = {}
    unknown: list[str] = []
    for var in os.environ:
        key = var.upper()
        if not key.startswith(upper):
            continue
        if key in by_field:
            found[by_field[key]] = var
        elif key not in others:
            unknown.append(var)
    if unknown:
        known = [*by_field, *sorted(others)]
        lines = [f"{var}{_suggest(var.upper(), known)}" for var in sorted(unknown)]
        raise ValueError(
            f"unknown environment variable{'s' if len(lines) > 1 else ''} "
            f"{', '.join(lines)}; EngineConfig reads {', '.join(by_field)}"
        )
    return found


def _from_sources(
    model: type[EngineConfig],
    prefix: str,
    config_file: str | os.PathLike[str] | None,
    overrides: dict[str, Any],
) -> EngineConfig:
    fields = model.model_fields
    settings = _source_model(model)
    env_names = _check_env_names(prefix, fields)
    if prefix.upper() == ENV_PREFIX:
        TransferSettings.from_env()  # the copy paths' variables: a bad one raises here
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if config_file is None and prefix:
        config_file = os.environ.get(prefix + "CONFIG") or None
    if config_file is not None:
        path = Path(config_file)
        for key, value in _read_file(settings, path, fields).items():
            values[key] = value
            origin[key] = f"config file {path}: {key}" + _shown(key, value)
    env = EnvSettingsSource(settings, env_prefix=prefix, case_sensitive=False)()
    for key, value in env.items():
        if key in fields:
            values[key] = value
            origin[key] = env_names.get(key, prefix + key.upper()) + _shown(key, value)
    for key, value in overrides.items():
        values[key] = value
        origin[key] = key + _shown(key, value)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = err["loc"]
            field = str(loc[0]) if loc else None
            if field is None:
                where = ", ".join(origin.values()) or "the defaults"
                lines.append(f"{err['msg']} (from {where})")
            else:
                where = origin.get(field, field)
                rest = "".join(f"[{part!r}]" for part in loc[1:])
                lines.append(f"{where}{rest}: {err['msg']}")
        # Not chained: pydantic's own error repeats every input, secrets included.
        raise ValueError("invalid EngineConfig: " + "; ".join(lines)) from None
