"""Profiles at other sequence lengths, scaled from one or two profiles of the same model and batch size.

Note: [sequence scaling] as with the micro-batch (Note: [batch scaling]), a step's activations, the inputs
autograd saves, the loss workspace and the ops' times grow with the sequence length while static memory,
the optimizer step and the time outside the ops do not. Unlike the batch, attention grows faster than the
length: under a math kernel the score ops (``q @ k^T``, its mask and scale, the softmax, its dropout) hold
``[batch, heads, s, s]`` tensors, and every attention kernel's work (FLOPs) is quadratic. So each op gets an
exponent ``k`` in ``[0, 2]`` (``v ~ s^k``: 0 a constant such as a fixed table, 1 a linear op, 2 a score op):

* From two profiles at ``s1 < s2``: bytes (output, saved) and FLOPs follow the power through both points,
  ``k = log(v2 / v1) / log(s2 / s1)`` clamped to ``[0, 2]``, anchored at the reference nearer ``s`` (sizes are
  exact: a linear op fits ``k = 1``, a score op ``k = 2``). A time is the op's launch overhead plus its work:
  ``t(s) = c0 + c s^k`` through both points, ``k`` the exponent of the op's FLOPs (of its output bytes when it
  counts none: memory-bound), ``c >= 0``. A power fit to times alone would take the overhead of a small op for
  its growth (``k`` near 0 at short lengths) and miss the work it gains at four times the length. Measured
  times that fall with the length (noise) scale from the longer reference by ``(s / s2)^k`` instead.
* From one profile at ``s1``: bytes are linear except the score ops' (Note: [score ops by kind]), quadratic;
  times and FLOPs are linear except the score ops', the attention kernels' (``aten._scaled_dot_product_*``)
  and the matmuls that read a score op (``probs @ v``), quadratic. A time's part up to the spec's
  ``kernel_latency`` (twice it in backward: about two kernels per op, the input's gradient and the weight's)
  stays: it does not grow with the work (llama-small, fake tensors, 512 to 2048 tokens: step time off by 6 %;
  llama-tiny, 32 to 128, where almost every op is that latency: off by 60 %, two references: 0 %).
* The workspace beyond the saved bytes (the peak minus static memory without gradients minus saved bytes) is
  the largest of its parts, each by its own law (Note: [workspace parts]): the gradients' share (constant in the
  gradients, simulated at ``s``), the loss workspace (linear, or the power through two references that show it)
  and one score op's output, the gradient of the scores a math attention's backward holds beside the saved bytes
  (hf:gemma2 on CPU: the workspace is the logits' up to 256 tokens, 1 MB, and the scores' gradients at 512,
  10 MB). The time of a measured step outside its ops (Python overhead, the allocator, the loss's glue) follows
  a line through two references (it grows with the length: 5.6 ms at 64 tokens, 9.8 ms at 256 on llama-tiny,
  CPU) and stays from one (as a batch-scaled profile's); the backward time charged to no op (gradient
  accumulation, parameter-sized) is the nearer reference's.

A scaled profile says so: ``model["extrapolated_from_seq_lens"]`` lists the lengths it was made from, and its
fingerprint keeps only the structure half (as a batch-scaled one's). :func:`seq_scaling_error` checks the rule
against a third measured length.

Note: [workspace parts] a measured peak is set either at the loss (all saved bytes held, plus the logits'
gradients: activation bytes, growing with the length) or in backward, where the parameters' gradients are made
while saved bytes are freed (a constant, the same at every length). llama-small batch 2 on CPU, 114 MiB of
gradients, has a workspace of 25 MiB at 128 tokens (the gradients') and of 16 MiB at 256 (twice the logits):
scaled linearly to 1024, the one at 128 tokens would be 199 MiB for the 64 measured (peak +12 %; from 64 tokens
+93 %; a qwen2 of width 256 from 32 tokens +117 %). The gradients' share is what the keep-all step simulated
without a workspace (gradients made by position, ``Profile.gradient_split``) holds beyond the saved bytes. The
loss workspace is estimated from the ops: twice the largest output after the layers (the logits' gradient and the
log-softmax's). A reference's workspace is its loss's where it exceeds the gradients' share, or where it is at
most 1.5 times the estimate (the loss's transients are not exactly the estimate: under the adaptive loop's hooks
llama-tiny's workspace is 1.28 times the estimate at 32 tokens, 0.75 at 128, a part of it constant; taken whole it
errs high, by half the estimate at most); else (a workspace the gradients explain, more than 1.5 times the
estimate: llama-small's 3.1 at 128 tokens, the qwen2's 1.6 at 64) the loss workspace is the estimate. At ``s``
the workspace is the largest of the gradients' share simulated at ``s``, the loss workspace (linear from the one
reference that shows it; from two, as an op's bytes: the power through both, linear from the longer beyond it;
from none, the estimate at ``s``) and one score op's output.

Note: [score ops by kind] with one profile the exponents cannot be measured, so the score ops are found by
their kind and place: each softmax (``aten._softmax``, ``aten._safe_softmax``; not the loss's log-softmax) of a
module, the ops of the same module it reads from back to (and including) the matmul that made the scores, and
the elementwise ops of that module that read it (dropout, a dtype cast); a matmul of that module reading any of
them (``probs @ v``) has a linear output but quadratic work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from profiler import Profile

from ._buckets import SeqLenBucketError, positive_length as _positive, seq_len_bucket
from ._scaling import _Line, _same_structure, keep_all_errors

__all__ = ["scale_to_seq_len", "seq_len_bucket", "SeqLenBucketError", "seq_scaling_error", "SeqScalingCheck",
           "SEQ_SCALING_TOLERANCE", "score_ops", "parse_seq_lens", "profile_for_seq_len"]

SEQ_SCALING_TOLERANCE = 0.1
"""Relative error of the keep-all peak, activation peak and step time a sequence-scaled profile is held to."""

_SOFTMAX = ("aten._softmax.", "aten._safe_softmax.")
_MATMUL = ("aten.bmm.", "aten.mm.", "aten.matmul.", "aten.baddbmm.", "aten.addmm.", "aten.einsum.")
_ATTENTION_KERNEL = "aten._scaled_dot_product_"


def parse_seq_lens(value: str | Iterable[int], key: str = "--seq-lens") -> tuple[int, ...]:
    """Sequence lengths as ``512,1024,2048`` or ints: ascending, each once."""
    items = value.split(",") if isinstance(value, str) else list(value)
    lengths = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        number = int(text) if isinstance(text, str) and text.isdigit() else text
        if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
            raise SeqLenBucketError(f"{key}={value!r}: expected positive integers separated by commas, e.g. "
                                    "512,1024,2048,4096")
        lengths.append(number)
    if not lengths:
        raise SeqLenBucketError(f"{key}={value!r}: expected positive integers separated by commas, e.g. 512,1024")
    return tuple(sorted(set(lengths)))


def profile_for_seq_len(profiles: Mapping[int, Profile], seq_len: int) -> Profile:
    """The profile at ``seq_len``: given; else scaled from the nearest given lengths below and above it; else (outside
    them) from the two nearest (Note: [bracketing profiles])."""
    if seq_len in profiles:
        return profiles[seq_len]
    if not profiles:
        raise ValueError("profiles: expected at least one profile to scale")
    below = [s for s in profiles if s < seq_len]
    above = [s for s in profiles if s > seq_len]
    pair = [max(below), min(above)] if below and above else \
        sorted(profiles, key=lambda s: (abs(math.log(s / seq_len)), s))[:2]
    return scale_to_seq_len(tuple(profiles[s] for s in pair), seq_len)


def _seq_len(profile: Profile, where: str) -> int:
    value = profile.model.get("seq_len")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}.model.seq_len={value!r}: expected a positive integer (the profile's sequence "
                         "length, needed to scale it to other lengths)")
    return value


def score_ops(profile: Profile) -> tuple[frozenset[int], frozenset[int]]:
    """Note: [score ops by kind]: the indices of the score ops, and of the ops with quadratic work (the score
    ops, the attention kernels and the matmuls reading a score op)."""
    ops = profile.ops
    producers: dict[int, list[int]] = {}
    for op in ops:
        for c in op.consumers:
            producers.setdefault(c, []).append(op.index)
    scores: set[int] = set()
    readers: set[int] = set()
    for seed in (op.index for op in ops if op.op.startswith(_SOFTMAX)):
        module, todo = ops[seed].module, [seed]
        scores.add(seed)
        while todo:
            i = todo.pop()
            if ops[i].op.startswith(_MATMUL) and i != seed:
                continue  # the matmul that made the scores: nothing before it
            for j in producers.get(i, []):
                if ops[j].module == module and j not in scores and j < i:
                    scores.add(j)
                    todo.append(j)
        todo = [seed]
        while todo:
            i = todo.pop()
            for j in ops[i].consumers:
                if ops[j].module != module or j in scores:
                    continue
                if ops[j].op.startswith(_MATMUL):
                    readers.add(j)
                else:
                    scores.add(j)
                    todo.append(j)
    kernels = {op.index for op in ops if op.op.startswith(_ATTENTION_KERNEL)}
    return frozenset(scores), frozenset(scores | readers | kernels)


class _Fit:
    """The exponents and anchors of one quantity of one op across the references (Note: [sequence scaling])."""

    def __init__(self, target: int, lengths: tuple[int, ...]) -> None:
        self.s = target
        self.lengths = lengths
        self.near = min(range(len(lengths)), key=lambda i: (abs(math.log(lengths[i] / target)), -i))

    def exponent(self, *values: float) -> float:
        if len(values) == 1 or min(values) <= 0:
            return 1.0
        (s1, s2), (v1, v2) = self.lengths, values
        return min(2.0, max(0.0, math.log(v2 / v1) / math.log(s2 / s1)))

    def power(self, values: tuple[float, ...], k: float | None = None) -> float:
        """``v ~ s^k``: ``k`` given (one reference), else fitted through both."""
        if len(values) == 2 and min(values) <= 0:
            return 0.0 if max(values) <= 0 else _Line(self.s, self.lengths)(*values)
        k = self.exponent(*values) if k is None else k
        return values[self.near] * (self.s / self.lengths[self.near]) ** k

    def time(self, values: tuple[float, ...], k: float, latency: float = 0.0) -> float:
        """``t = c0 + c s^k`` through both references (``c >= 0``); from one, ``t - latency ~ s^k`` (Note:
        [sequence scaling])."""
        if len(values) == 1 or k == 0:
            t = values[self.near]
            fixed = min(t, latency) if k else 0.0
            return fixed + (t - fixed) * (self.s / self.lengths[self.near]) ** k
        (s1, s2), (t1, t2) = self.lengths, values
        if t2 <= t1:
            return t2 * (self.s / s2) ** k
        c = (t2 - t1) / (s2 ** k - s1 ** k)
        return max(0.0, t1 + c * (self.s ** k - s1 ** k))


def _scaled_ops(refs: tuple[Profile, ...], fit: _Fit) -> list:
    first = refs[0]
    latency = first.hardware.kernel_latency
    if len(refs) == 1:
        scores, work = score_ops(first)
    out = []
    for i, op in enumerate(first.ops):
        rops = [r.ops[i] for r in refs]
        if len(refs) == 1:
            kb, kt = (2.0 if i in scores else 1.0), (2.0 if i in work else 1.0)
            size = {q: fit.power((getattr(op, q),), kb) for q in ("output_bytes", "saved_bytes")}
            flops = fit.power((op.flops,), kt)
        else:
            size = {q: fit.power(tuple(getattr(o, q) for o in rops)) for q in ("output_bytes", "saved_bytes")}
            flops = fit.power(tuple(o.flops for o in rops))
            if all(o.flops > 0 for o in rops):
                kt = fit.exponent(*(o.flops for o in rops))
            elif all(o.output_bytes > 0 for o in rops):
                kt = fit.exponent(*(o.output_bytes for o in rops))
            else:
                kt = 1.0
        out.append(replace(op, output_bytes=int(round(size["output_bytes"])),
                           saved_bytes=int(round(size["saved_bytes"])), flops=int(round(flops)),
                           fwd_time=fit.time(tuple(o.fwd_time for o in rops), kt, latency),
                           bwd_time=fit.time(tuple(o.bwd_time for o in rops), kt, 2 * latency)))
    return out


def _scaled_units(ref: Profile, ops: list) -> list:
    """Each unit the sum of its scaled ops; a unit whose figures are not its ops' sums keeps its ratio to them."""
    units = []
    for u in ref.units:
        new = {}
        for q in ("output_bytes", "saved_bytes", "fwd_time", "bwd_time"):
            was, now = sum(getattr(ref.ops[i], q) for i in u.ops), sum(getattr(ops[i], q) for i in u.ops)
            value = getattr(u, q)
            new[q] = now if math.isclose(value, was, rel_tol=1e-9, abs_tol=1e-15) else \
                (value * now / was if was else value)
        units.append(replace(u, output_bytes=int(round(new["output_bytes"])),
                             saved_bytes=int(round(new["saved_bytes"])), fwd_time=new["fwd_time"],
                             bwd_time=new["bwd_time"]))
    return units


def _keep_all_peak(profile: Profile) -> int:
    """The keep-all step's simulated peak, gradients included."""
    from ._budget import keep_all
    from ._model import StepModel
    from ._simulator import simulate_assignment

    model = StepModel.build(profile)
    return simulate_assignment(model, keep_all(model)).peak_bytes


def _gradient_share(profile: Profile) -> int:
    """Note: [workspace parts] the workspace the gradients explain: the keep-all step's simulated peak (gradients
    made in backward, saved bytes freed as it goes) with no loss workspace, less static memory without gradients
    and the saved bytes."""
    bare = replace(profile, peak_memory=_no_grads(profile) + profile.saved_bytes)
    return max(0, _keep_all_peak(bare) - bare.peak_memory)


def _no_grads(profile: Profile) -> int:
    return profile.static.total - profile.static.gradients


def _loss_estimate(profile: Profile) -> int:
    """Note: [workspace parts] twice the largest output of the ops after the layers (the logits' gradients)."""
    last = max((op.index for op in profile.ops if op.layer is not None), default=-1)
    return 2 * max((op.output_bytes for op in profile.ops[last + 1:]), default=0)


_LOSS_COPIES = 1.5
"""Note: [workspace parts] a workspace up to this many times the estimate is taken as the loss's."""


def _loss_part(ref: Profile) -> tuple[int, bool]:
    """Note: [workspace parts] the reference's loss workspace, and whether its peak showed it (else estimated)."""
    space = max(0, ref.peak_memory - _no_grads(ref) - ref.saved_bytes)
    estimate = _loss_estimate(ref)
    if space > _gradient_share(ref) or space <= _LOSS_COPIES * estimate:
        return space, True
    return estimate, False


def _workspace(refs: tuple[Profile, ...], fit: _Fit, draft: Profile, score_bytes: int) -> int:
    """Note: [workspace parts] the workspace beyond the saved bytes at ``fit.s``: the largest of its parts."""
    parts = [_loss_part(r) for r in refs]
    seen = [i for i, (_, shown) in enumerate(parts) if shown]
    if len(seen) == 2:
        spaces = tuple(v for v, _ in parts)
        linear = spaces[-1] * fit.s / fit.lengths[-1] if fit.s > fit.lengths[-1] else 0.0
        loss = max(linear, fit.power(spaces))
    elif seen:
        loss = parts[seen[0]][0] * fit.s / fit.lengths[seen[0]]
    else:
        loss = _loss_estimate(draft)
    return int(round(max(loss, _gradient_share(draft), score_bytes)))


def _references(refs: Profile | tuple[Profile, ...], seq_len: int) -> tuple[tuple[Profile, ...], tuple[int, ...]]:
    refs = (refs,) if isinstance(refs, Profile) else tuple(refs)
    if not 1 <= len(refs) <= 2:
        raise ValueError(f"refs: {len(refs)} profiles; expected one profile or two at different sequence lengths")
    lengths = [_seq_len(p, f"refs[{i}]") for i, p in enumerate(refs)]
    if len(refs) == 2:
        if refs[0].model.get("batch_size") != refs[1].model.get("batch_size"):
            raise ValueError(f"refs[1].model.batch_size={refs[1].model.get('batch_size')!r}: expected the first "
                             f"profile's {refs[0].model.get('batch_size')!r} (scaling by length keeps the batch)")
        if lengths[0] == lengths[1] or not _same_structure(*refs):  # one reference: the nearer one
            near = min((0, 1), key=lambda i: (abs(math.log(lengths[i] / seq_len)), -lengths[i]))
            refs, lengths = (refs[near],), [lengths[near]]
    order = sorted(range(len(refs)), key=lambda i: lengths[i])
    return tuple(refs[i] for i in order), tuple(lengths[i] for i in order)


def scale_to_seq_len(refs: Profile | tuple[Profile, ...], seq_len: int) -> Profile:
    """``refs`` (one profile, or two of the same model and batch size at different sequence lengths) scaled to
    ``seq_len`` (Note: [sequence scaling])."""
    _positive("seq_len", seq_len)
    refs, lengths = _references(refs, seq_len)
    if lengths == (seq_len,):
        return refs[0]
    fit = _Fit(seq_len, lengths)
    first, near = refs[0], refs[fit.near]
    ops = _scaled_ops(refs, fit)
    units = _scaled_units(first, ops)
    no_grads = _no_grads(first)
    saved_inputs = int(round(fit.power(tuple(r.saved_input_bytes for r in refs))))
    compute = sum(u.fwd_time + u.bwd_time for u in units)
    outside = fit.time(tuple(max(0.0, r.step_time - sum(u.fwd_time + u.bwd_time for u in r.units)) for r in refs),
                       0.0 if len(refs) == 1 else 1.0)
    fingerprint = first.model.get("fingerprint")
    model = {**first.model, "seq_len": seq_len, "extrapolated_from_seq_lens": list(lengths),
             "fingerprint": fingerprint.partition("-")[0] if isinstance(fingerprint, str) else fingerprint}
    saved = sum(u.saved_bytes for u in units) + saved_inputs
    draft = replace(first, model=model, ops=ops, units=units, peak_memory=no_grads + saved,
                    saved_input_bytes=saved_inputs, step_time=compute + outside,
                    unattributed_time=near.unattributed_time, layer_forward=[])  # measured at its length only
    workspace = _workspace(refs, fit, draft, max((ops[i].output_bytes for i in score_ops(first)[0]), default=0))
    return replace(draft, peak_memory=no_grads + saved + workspace)


@dataclass(frozen=True)
class SeqScalingCheck:
    """A measured profile against the one scaled to its sequence length from others."""
    seq_len: int
    scaled_from: tuple[int, ...]
    activation_error: float
    """Relative error of the keep-all step's activation peak (``search.planning.activation_peak``)."""
    time_error: float
    """Relative error of the keep-all step's simulated time."""
    peak_error: float = 0.0
    """Relative error of the keep-all step's simulated peak, gradients included: what a plan is searched against."""

    @property
    def ok(self) -> bool:
        return max(self.activation_error, self.time_error, self.peak_error) <= SEQ_SCALING_TOLERANCE

    def describe(self) -> str:
        return (f"scaling check: sequence length {self.seq_len} measured vs extrapolated from "
                f"{', '.join(map(str, self.scaled_from))}: peak off by {self.peak_error:.1%}, activation peak by "
                f"{self.activation_error:.1%}, step time by {self.time_error:.1%}"
                + ("" if self.ok else f" (above {SEQ_SCALING_TOLERANCE:.0%})"))


def seq_scaling_error(measured: Profile, refs: Profile | tuple[Profile, ...]) -> SeqScalingCheck:
    """``measured`` against ``refs`` scaled to its sequence length: keep-all activation peak, step time and
    peak."""
    s = _seq_len(measured, "measured")
    scaled = scale_to_seq_len(refs, s)
    peaks = _keep_all_peak(measured), _keep_all_peak(scaled)
    return SeqScalingCheck(s, tuple(scaled.model["extrapolated_from_seq_lens"]), *keep_all_errors(measured, scaled),
                           peak_error=abs(peaks[1] - peaks[0]) / peaks[0])
