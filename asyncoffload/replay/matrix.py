"""Many replays: every ``policy[+admission]`` spec at every capacity
(:func:`replay_matrix`), the offline bound among them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncoffload.replay.bound import BELADY, belady
from asyncoffload.replay.engine import replay_engine
from asyncoffload.replay.manager import DISK_ADMISSION, parse_disk_admission, replay
from asyncoffload.replay.result import (
    LLAMA3_8B_BYTES_PER_TOKEN,
    ReplayResult,
    _share_label,
    capacity_blocks,
)
from asyncoffload.workloads import Request, summarize

__all__ = ["ALL_SPECS_EXTRA", "expand_specs", "parse_spec", "replay_matrix"]


#: What ``all`` adds to the registered policies: the admission filters worth comparing.
ALL_SPECS_EXTRA = ("lru+ghost", "lru+adaptive", "kv+adaptive")


def expand_specs(values: Sequence[str] | None) -> list[str]:
    """The specs named by ``values`` (each comma-separated; ``None``: ``["all"]``), in
    order, without repeats: ``all`` is every registered policy and
    :data:`ALL_SPECS_EXTRA`. Not checked (see :func:`parse_spec`)."""
    from asyncoffload.manager import available_policies

    specs: list[str] = []
    for value in values or ["all"]:
        for part in value.split(","):
            part = part.strip()
            if part == "all":
                specs.extend(available_policies())
                specs.extend(ALL_SPECS_EXTRA)
            elif part:
                specs.append(part)
    return list(dict.fromkeys(specs))


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"kv"`` -> ``("kv", None)``; ``"lru+ghost"`` -> ``("lru", "ghost")``; ``ValueError``
    naming the unknown part otherwise (``"belady"`` is the offline bound)."""
    from asyncoffload.manager.admission import get_admission_cls
    from asyncoffload.manager.policies import get_policy_cls

    name, plus, adm = spec.strip().partition("+")
    if name == BELADY:
        if plus:
            raise ValueError(f"{spec!r}: the offline bound takes no admission filter")
        return name, None
    get_policy_cls(name)
    if plus:
        get_admission_cls(adm)
        return name, adm
    return name, None


def replay_matrix(
    requests: Sequence[Request],
    shares: Sequence[float],
    specs: Sequence[str],
    *,
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN,
    progress: Callable[[str, int, int], None] | None = None,
    engine: bool = False,
    disk_shares: Sequence[float | None] | None = None,
    disk_policy: str = "lru",
    disk_admission: str | None = DISK_ADMISSION,
) -> list[ReplayResult]:
    """Replay every ``policy[+admission]`` spec (or ``"belady"``) at every capacity share.

    Specs are checked before anything runs. ``engine=True`` runs the online policies
    through the async engine with real bytes (:func:`replay_engine`); each result's
    ``extra["mismatches"]`` counts loaded blocks whose bytes were wrong.

    ``disk_shares`` (shares of the unique blocks, above 1 allowed; ``None`` in the list:
    no disk tier) runs every online spec at every CPU share x disk share, with a disk
    tier of ``disk_policy`` and ``disk_admission`` (see :func:`replay`); the offline
    bound runs once per CPU share, for the CPU tier alone. Not with ``engine``."""
    from asyncoffload.loops import run
    from asyncoffload.manager.policies import get_policy_cls

    parsed = [parse_spec(spec) for spec in specs]
    unique = summarize(requests).unique_blocks
    disks: list[float | None] = [None]
    if disk_shares is not None:
        if engine:
            raise ValueError("the engine replay models the CPU tier only: no disk_shares")
        if disk_policy == BELADY:
            raise ValueError("the disk tier takes an online policy, not the offline bound")
        get_policy_cls(disk_policy)
        parse_disk_admission(disk_admission)
        disks = list(dict.fromkeys(disk_shares))
    runs = [
        (share, name, adm, disk)
        for share in shares
        for name, adm in parsed
        for disk in ([None] if name == BELADY else disks)
    ]
    caps = {share: capacity_blocks(share, unique) for share in shares}
    disk_caps = {d: capacity_blocks(d, unique) for d in disks if d is not None}
    results: list[ReplayResult] = []
    total = len(runs) * len(requests)
    for j, (share, name, adm, disk) in enumerate(runs):
        cap = caps[share]
        label = f"{name}{'+' + adm if adm else ''} @ {_share_label(share)}"
        if disk is not None:
            label += f" + disk {_share_label(disk)}"
        base = j * len(requests)

        def step(done: int, _total: int, base: int = base, label: str = label) -> None:
            if progress is not None:
                progress(label, base + done, total)

        if name == BELADY:
            res = belady(
                requests,
                cap,
                bytes_per_token=bytes_per_token,
                unique_blocks=unique,
                share=share,
                progress=step,
            )
        elif engine:
            res, bad = run(
                replay_engine(
                    requests,
                    cap,
                    policy=name,
                    admission=adm,
                    unique_blocks=unique,
                    share=share,
                    progress=step,
                )
            )
            res.extra["mismatches"] = float(bad)
        else:
            res = replay(
                requests,
                cap,
                policy=name,
                admission=adm,
                bytes_per_token=bytes_per_token,
                unique_blocks=unique,
                share=share,
                progress=step,
                disk_capacity=None if disk is None else disk_caps[disk],
                disk_policy=disk_policy,
                disk_admission=disk_admission,
                disk_share=disk,
            )
        results.append(res)
    return results
