"""The profile of each sequence-length bucket (Note: [plan buckets]): given at that length, made by a caller's
function (``adaptive-mem search --model``: profiled as the first was), else scaled from the given ones (Note:
[sequence scaling])."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

from profiler import Profile

from ._seq_scaling import parse_seq_lens, profile_for_seq_len

__all__ = ["profiles_by", "seq_len_profiles", "structure_of"]


def structure_of(profile: Profile) -> str | None:
    """The structure half of a profile's fingerprint (the input half names its shapes)."""
    fingerprint = profile.model.get("fingerprint")
    return fingerprint.partition("-")[0] if isinstance(fingerprint, str) else None


def _same_model(profile: Profile, first: Profile, same: tuple[str, ...]) -> bool:
    return (structure_of(profile) == structure_of(first) and profile.num_layers == first.num_layers
            and all(profile.model.get(k) == first.model.get(k) for k in same))


def profiles_by(items: Any, field: str, *, why: str, same: tuple[str, ...] = ()) -> dict[int, Profile]:
    """The given profiles (objects or files) by ``profile.model[field]`` (``seq_len``, ``batch_size``): one model,
    the same ``same`` fields, one profile per value; ``why``: what the values are for, said when one is missing."""
    items = [items] if isinstance(items, (Profile, str, Path)) else list(items)
    label, others = field.replace("_", " "), [k.replace("_", " ") for k in same]
    out: dict[int, Profile] = {}
    for i, item in enumerate(items):
        where = f"profiles[{i}]" if isinstance(item, Profile) else str(item)
        profile = item if isinstance(item, Profile) else Profile.load(item)
        value = profile.model.get(field)
        if value is None:
            raise ValueError(f"profile={where!r}: profile.model.{field} is missing; expected the {label} it was made "
                             f"at ({why})")
        if value in out:
            raise ValueError(f"profile={where!r}: a second profile at {label} {value}; expected one per {label}")
        if out and not _same_model(profile, next(iter(out.values())), same):
            raise ValueError(f"profile={where!r}: another model{''.join(' or ' + o for o in others)} than the first "
                             f"profile's; expected profiles of one model{''.join(' and ' + o for o in others)} at "
                             f"different {label}s")
        out[value] = profile
    return out


def seq_len_profiles(profiles: Profile | str | Path | Iterable[Profile | str | Path], seq_lens: str | Iterable[int],
                     profile_at: Callable[[Profile, int], Profile] | None = None) -> dict[int, Profile]:
    """The profile of each of ``seq_lens``: given; else ``profile_at(first given, seq_len)`` when given; else
    scaled from the given ones (the nearest below and above, else the two nearest)."""
    lengths = parse_seq_lens(seq_lens)
    given = profiles_by(profiles, "seq_len", why="--seq-lens scales by it", same=("batch_size",))
    if not given:
        raise ValueError("profile: none given; expected a profile to scale to the --seq-lens")
    first = next(iter(given.values()))
    out = {}
    for s in lengths:
        if s not in given and profile_at is not None:
            given[s] = profile_at(first, s)
            if not _same_model(given[s], first, ("batch_size",)):
                raise ValueError(f"profile='profiled at sequence length {s}': another model or batch size than the "
                                 "first profile's; expected profiles of one model and batch size at different "
                                 "sequence lengths")
        out[s] = profile_for_seq_len(given, s)
    return out
