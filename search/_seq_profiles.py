"""The profile of each sequence-length bucket (Note: [plan buckets]): given at that length, made by a caller's
function (``adaptive-mem search --model``: profiled as the first was), else scaled from the given ones (Note:
[sequence scaling])."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

from profiler import Profile

from ._seq_scaling import parse_seq_lens, profile_for_seq_len

__all__ = ["seq_len_profiles", "structure_of"]


def structure_of(profile: Profile) -> str | None:
    """The structure half of a profile's fingerprint (the input half names its shapes)."""
    fingerprint = profile.model.get("fingerprint")
    return fingerprint.partition("-")[0] if isinstance(fingerprint, str) else None


def _check_same_model(profile: Profile, first: Profile, where: str) -> None:
    if structure_of(profile) != structure_of(first) or profile.num_layers != first.num_layers \
            or profile.model.get("batch_size") != first.model.get("batch_size"):
        raise ValueError(f"profile={where!r}: another model or batch size than the first profile's; expected "
                         "profiles of one model and batch size at different sequence lengths")


def _load(items: Any) -> dict[int, Profile]:
    """The given profiles by sequence length: one model, one batch size, one profile per length."""
    items = [items] if isinstance(items, (Profile, str, Path)) else list(items)
    out: dict[int, Profile] = {}
    for i, item in enumerate(items):
        where = f"profiles[{i}]" if isinstance(item, Profile) else str(item)
        profile = item if isinstance(item, Profile) else Profile.load(item)
        s = profile.model.get("seq_len")
        if s is None:
            raise ValueError(f"profile={where!r}: profile.model.seq_len is missing; expected the sequence length it "
                             "was made at (--seq-lens scales by it)")
        if s in out:
            raise ValueError(f"profile={where!r}: a second profile at sequence length {s}; expected one per length")
        if out:
            _check_same_model(profile, next(iter(out.values())), where)
        out[s] = profile
    if not out:
        raise ValueError("profile: none given; expected a profile to scale to the --seq-lens")
    return out


def seq_len_profiles(profiles: Profile | str | Path | Iterable[Profile | str | Path], seq_lens: str | Iterable[int],
                     profile_at: Callable[[Profile, int], Profile] | None = None) -> dict[int, Profile]:
    """The profile of each of ``seq_lens``: given; else ``profile_at(first given, seq_len)`` when given; else
    scaled from the given ones (the nearest below and above, else the two nearest)."""
    lengths = parse_seq_lens(seq_lens)
    given = _load(profiles)
    first = next(iter(given.values()))
    out = {}
    for s in lengths:
        if s not in given and profile_at is not None:
            given[s] = profile_at(first, s)
            _check_same_model(given[s], first, f"profiled at sequence length {s}")
        out[s] = profile_for_seq_len(given, s)
    return out
