"""Storage tiers and the medium-string alias table (SGLang and Dynamo spellings)."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    DEVICE = "device"  # GPU memory (HiCache L1)
    HOST = "host"  # pinned host RAM (HiCache L2)
    DISK = "disk"  # local disk / NVMe tier
    EXTERNAL = "external"  # a store outside the worker (e.g. the shared Mooncake pool)

    @property
    def bit(self) -> int:
        return TIER_BITS[self]


#: Each tier's bit; as one hex digit it tags a page's member in its worker's pages set (state_keys.py).
TIER_BITS: dict[Tier, int] = {Tier.DEVICE: 1, Tier.HOST: 2, Tier.DISK: 4, Tier.EXTERNAL: 8}
ALL_TIER_BITS = 15

#: Walk order of the overlap contract: device first, then host, then disk.
TIER_PRIORITY: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL)

_MEDIUM_ALIASES: dict[str, Tier] = {
    "GPU": Tier.DEVICE,
    "DEVICE": Tier.DEVICE,
    "CPU": Tier.HOST,
    "CPU_PINNED": Tier.HOST,
    "CPU_TIER1": Tier.HOST,
    "DISK": Tier.DISK,
    "CPU_TIER2": Tier.DISK,
    "NVME": Tier.DISK,
    "STORAGE": Tier.DISK,
    "EXTERNAL": Tier.EXTERNAL,
    "SHARED": Tier.EXTERNAL,
    "REMOTE": Tier.EXTERNAL,
    "NETWORK": Tier.EXTERNAL,
}


class UnknownMedium(ValueError):
    pass


def tier_of_medium(medium: str | None) -> Tier:
    """Map an engine's medium string to a tier. A missing medium means GPU (SGLang's default)."""
    if medium is None or medium == "":
        return Tier.DEVICE
    try:
        return _MEDIUM_ALIASES[medium.upper()]
    except (KeyError, AttributeError):
        known = ", ".join(sorted(_MEDIUM_ALIASES))
        raise UnknownMedium(f"unknown medium {medium!r}; known: {known}") from None


def tiers_of_bits(bits: int) -> list[Tier]:
    return [t for t in TIER_PRIORITY if bits & TIER_BITS[t]]
