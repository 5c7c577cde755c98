"""Sequence-length buckets: the bucket a length falls in (Note: [plan buckets]); no imports, so the plan type and
the scaling both use this one rule."""

from __future__ import annotations

__all__ = ["SeqLenBucketError", "positive_length", "seq_len_bucket"]


class SeqLenBucketError(ValueError):
    """A sequence length no bucket covers, or bucket lengths that are not positive integers."""


def positive_length(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SeqLenBucketError(f"{name}={value!r}: expected a positive integer")
    return value


def seq_len_bucket(seq_len: int, buckets: tuple[int, ...] | None = None) -> int:
    """The bucket ``seq_len`` falls in: the smallest of ``buckets`` at least ``seq_len`` (default: the powers of
    two). A length above the largest bucket raises :class:`SeqLenBucketError`."""
    positive_length("seq_len", seq_len)
    if buckets is None:
        return 1 << (seq_len - 1).bit_length()
    sizes = sorted({positive_length("seq_len_buckets[]", b) for b in buckets})
    if not sizes:
        raise SeqLenBucketError("seq_len_buckets=(): expected at least one bucket length")
    for size in sizes:
        if size >= seq_len:
            return size
    raise SeqLenBucketError(f"seq_len={seq_len}: above the largest bucket {sizes[-1]} (buckets "
                            f"{','.join(map(str, sizes))}); expected a length <= {sizes[-1]} or a plan with a "
                            "longer bucket")
