"""Model specs: turn ``--model SPEC`` into a model plus one step's inputs and loss.

Accepted forms of ``SPEC``:

* a preset name of the reference model (``llama-tiny``, ``llama-small``,
  ``llama2-7b``, ``llama2-70b``); ``model_args`` override ``LlamaConfig`` fields;
* ``hf:<family>`` (``hf:llama``, ``hf:gpt2``, ... see ``HF_FAMILIES``): a
  ``transformers`` model built from its config class with random weights and
  tiny default sizes (3 layers, width 64); ``model_args`` override config
  attributes. Causal LMs, plus ``hf:bert`` (masked LM: 15% of the tokens masked,
  HF's loss) and ``hf:t5`` (encoder input ids, decoder input ids, labels; HF's loss);
* ``package.module:factory``: your own model. The factory is called as
  ``factory(**model_args)`` and returns either

  - an ``nn.Module`` treated as a causal LM: it takes ``input_ids`` of shape
    ``(batch, seq)`` (int64, values below its vocabulary size, read from
    ``config.vocab_size``, ``vocab_size`` or its first ``nn.Embedding``) and
    returns logits ``(batch, seq, vocab)`` (a tensor, a tuple whose first item is
    the logits, or an object with ``.logits``); the loss is next-token cross
    entropy. It is moved to ``dtype``/``device`` by :func:`build_model`.
  - or a :class:`ModelBundle`, used as is (for models that are not causal LMs:
    set ``batch_fn`` and ``loss_fn``); its sizes, dtype and device are its own.

``device="meta"`` builds everything under one ``FakeTensorMode``: shapes and
dtypes are exact, nothing is allocated, so a 70B config is planned on a laptop.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch
from torch import nn

from profiler.tracing import install_fake_fallbacks

from .models._errors import ModelSpecError
from .models._loss import causal_lm_loss
from .models._hf import HF_FAMILIES, HF_HEADS, build_hf as _build_hf, hf_unpacked_sequences as _hf_unpacked_sequences

__all__ = ["ModelBundle", "ModelSpecError", "build_model", "parse_model_args", "HF_FAMILIES", "DTYPES"]

log = logging.getLogger(__name__)

install_fake_fallbacks()  # Note: [fake op fallbacks]: fp32 grouped_mm experts on fake tensors, in every fake pass

FORMS = (f"a preset (llama-tiny, llama-small, llama2-7b, llama2-70b), hf:<family> ({', '.join(HF_FAMILIES)}) "
         "or package.module:factory")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

_DEFAULT_BATCH = 2
_DEFAULT_SEQ = 64

_SIZE_KEY = re.compile(r"(size|layers|heads|dim|experts|positions|vocab|^n_|_tok$|max_seq_len)")


@dataclass
class ModelBundle:
    """A model and what one training step feeds it."""

    model: nn.Module
    """The model, in train mode, on ``device`` (fake tensors when ``device`` is meta)."""
    spec: str
    """The spec it was built from."""
    batch_size: int
    """Micro-batch size of :meth:`batch`."""
    seq_len: int
    """Sequence length of :meth:`batch`."""
    dtype: torch.dtype
    """Parameter and activation dtype."""
    device: torch.device
    """Where the step runs; ``meta`` means fake tensors under ``fake_mode``."""
    vocab_size: int = 0
    """Token ids of :meth:`batch` are below this (causal LMs)."""
    fake_mode: Any = None
    """The ``FakeTensorMode`` holding the model when ``device`` is meta, else None."""
    batch_fn: Callable[[int], tuple[torch.Tensor, ...]] | None = None
    """Custom inputs ``seed -> tensors`` (models that are not causal LMs); default: token ids and labels."""
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor] | None = None
    """Custom ``(model, batch) -> scalar loss``; default: next-token cross entropy on the logits."""

    @property
    def is_fake(self) -> bool:
        return self.fake_mode is not None

    def mode(self) -> contextlib.AbstractContextManager:
        """Context to run the model in: the fake mode on meta, a no-op otherwise."""
        return self.fake_mode if self.fake_mode is not None else contextlib.nullcontext()

    def batch(self, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """One step's inputs on the device, deterministic per ``seed``: ``(input_ids, labels)`` by default."""
        if self.batch_fn is not None:
            return tuple(self.batch_fn(seed))
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=gen)
        ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.fake_mode is not None:
            return self.fake_mode.from_tensor(ids), self.fake_mode.from_tensor(labels)
        return ids.to(self.device), labels.to(self.device)

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Forward and a scalar loss (no backward); raises ModelSpecError when it has no grad."""
        hf = (self.loss_fn is None or self.spec.startswith("hf:")) and not getattr(self.loss_fn, "packed", False)
        unpacked = _hf_unpacked_sequences() if self.fake_mode is not None and hf else None
        with self.mode(), unpacked or contextlib.nullcontext():
            if self.loss_fn is not None:
                loss = self.loss_fn(self.model, batch)
            else:
                ids, labels = batch
                logits = _logits(self.model(ids))
                loss = causal_lm_loss(logits, labels)  # Note: [loss in fp32]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ModelSpecError(
                f"model spec {self.spec!r}: loss is not a scalar tensor; expected a model returning logits"
            )
        if not loss.requires_grad:
            raise ModelSpecError(
                f"model spec {self.spec!r}: the model's output has no grad; expected trainable parameters in the graph"
            )
        return loss


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ModelSpecError(f"model output {type(output).__name__}: expected logits (a tensor, a tuple, or .logits)")


# ---------------------------------------------------------------------------- arguments
def parse_model_args(text: dict | str | None) -> dict[str, Any]:
    """``"num_hidden_layers=2,hidden_size=128,tie_word_embeddings=false"`` -> dict (int/float/bool/str values)."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        return dict(text)
    if not isinstance(text, str):
        raise ModelSpecError(f"model_args={text!r}: expected 'key=value,...' or a dict")
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key.isidentifier() or not raw:
            raise ModelSpecError(f"model_args item {item.strip()!r}: expected key=value (e.g. num_hidden_layers=2)")
        out[key] = _parse_value(raw)
    return out


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _check_sizes(args: dict[str, Any], where: str) -> None:
    for key, value in args.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if _SIZE_KEY.search(key) and value <= 0:
            raise ModelSpecError(f"{where}: model_args {key}={value}: expected a positive integer")


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ModelSpecError(f"dtype={value}: expected a floating-point dtype ({', '.join(sorted(DTYPES))})")
        return value
    key = str(value).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise ModelSpecError(f"dtype={value!r}: expected one of {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


def _positive(name: str, value: int | None, spec: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ModelSpecError(f"model spec {spec!r}: {name}={value!r}: expected a positive integer")


# ---------------------------------------------------------------------------- builders
def _build_preset(
    name: str, args: dict[str, Any], batch: int | None, seq: int | None
) -> tuple[nn.Module, int, int, int]:
    from .models import PRESETS, LlamaModel

    preset = PRESETS[name]
    known = {f.name for f in fields(preset.config)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ModelSpecError(f"model spec {name!r}: model_args key {unknown[0]!r}: expected one of {sorted(known)}")
    seq = preset.seq_len if seq is None else seq
    if "max_seq_len" not in args and seq > preset.config.max_seq_len:
        args = {**args, "max_seq_len": seq}
    try:
        config = replace(preset.config, **args)
    except (ValueError, TypeError) as exc:
        raise ModelSpecError(f"model spec {name!r}: {exc}") from None
    if seq > config.max_seq_len:
        raise ModelSpecError(f"model spec {name!r}: seq_len={seq}: expected at most max_seq_len={config.max_seq_len}")
    return LlamaModel(config), preset.batch_size if batch is None else batch, seq, config.vocab_size


def _hf_step(family: str, vocab: int, batch: int, seq: int, device: torch.device, fake_mode: Any) -> tuple[
        Callable[[int], tuple[torch.Tensor, ...]], Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]]:
    """``batch_fn`` and ``loss_fn`` of the Hugging Face families that are not causal LMs (HF computes the loss)."""

    def place(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if fake_mode is not None:
            return tuple(fake_mode.from_tensor(t) for t in tensors)
        return tuple(t.to(device) for t in tensors)

    def batch_fn(seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (batch, seq), generator=gen)
        if family == "bert":  # mask 15% of the tokens (at least one per row); the loss reads only those
            masked = torch.rand((batch, seq), generator=gen) < 0.15
            masked[:, 0] = True
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            return place(torch.where(masked, torch.full_like(ids, vocab - 1), ids), labels)
        labels = torch.randint(3, vocab, (batch, seq), generator=gen)
        decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        return place(ids, decoder_ids, labels)

    def loss_fn(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if family == "bert":
            return model(input_ids=b[0], labels=b[1]).loss
        return model(input_ids=b[0], decoder_input_ids=b[1], labels=b[2]).loss

    return batch_fn, loss_fn


def _vocab_size(model: nn.Module) -> int:
    for owner in (getattr(model, "config", None), model):
        value = getattr(owner, "vocab_size", None)
        if isinstance(value, int) and value > 0:
            return value
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    return 0


def _build_factory(spec: str, args: dict[str, Any]) -> nn.Module | ModelBundle:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's spec
        reason = f"{type(exc).__name__}: {exc}"
        raise ModelSpecError(f"model spec {spec!r}: cannot import {module_name!r} ({reason})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSpecError(f"model spec {spec!r}: {module_name} has no callable {attr!r}")
    try:
        result = factory(**args)
    except Exception as exc:  # noqa: BLE001 - a failing factory is reported, not crashed on
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelSpecError(f"model spec {spec!r}: factory raised {type(exc).__name__}: {first}") from None
    if not isinstance(result, (nn.Module, ModelBundle)):
        raise ModelSpecError(
            f"model spec {spec!r}: factory returned {type(result).__name__}; expected an nn.Module or a ModelBundle"
        )
    return result


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _maybe(mode: Any) -> contextlib.AbstractContextManager:
    return mode if mode is not None else contextlib.nullcontext()


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _target(device: str) -> tuple[torch.device, Any]:
    """The torch device of ``device`` and, on ``meta``, the fake-tensor mode the model is built under."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelSpecError(f"device={device!r}: expected cpu, meta, cuda[:N] or another torch device") from None
    if target.type != "meta":
        return target, None
    from torch._subclasses.fake_tensor import FakeTensorMode

    return target, FakeTensorMode(allow_non_fake_inputs=True)


def _build(spec: str, args: dict, batch_size: int | None, seq_len: int | None,
           is_preset: bool) -> ModelBundle | tuple[nn.Module, int, int, int]:
    """``(model, batch_size, seq_len, vocab)`` of ``spec``; a factory's own :class:`ModelBundle` as it is."""
    if is_preset:
        return _build_preset(spec, args, batch_size, seq_len)
    seq_len = _DEFAULT_SEQ if seq_len is None else seq_len
    batch_size = _DEFAULT_BATCH if batch_size is None else batch_size
    if spec.startswith("hf:"):
        model, vocab = _build_hf(spec, spec[3:], args, seq_len)
        return model, batch_size, seq_len, vocab
    built = _build_factory(spec, args)
    if isinstance(built, ModelBundle):
        log.info("model spec %s: factory returned a ModelBundle; its sizes, dtype and device are used", spec)
        return built
    vocab = _vocab_size(built)
    if vocab <= 0:
        raise ModelSpecError(
            f"model spec {spec!r}: cannot find the vocabulary size; expected config.vocab_size, "
            "vocab_size or an nn.Embedding (or return a ModelBundle)"
        )
    return built, batch_size, seq_len, vocab


def _place(model: nn.Module, spec: str, device: str, target: torch.device, torch_dtype: torch.dtype,
           fake_mode: Any) -> nn.Module:
    """``model`` on ``target`` in ``torch_dtype`` (built there already under a fake-tensor mode)."""
    if fake_mode is None:
        try:
            return model.to(device=target, dtype=torch_dtype)
        except (RuntimeError, AssertionError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelSpecError(f"device={device!r}: not usable here ({first}); expected cpu or meta") from None
    if any(p.dtype != torch_dtype for p in model.parameters() if p.is_floating_point()):
        raise ModelSpecError(f"model spec {spec!r}: parameters not built in dtype={torch_dtype} on meta")
    return model


def build_model(
    spec: str,
    *,
    model_args: dict | str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    seed: int = 0,
) -> ModelBundle:
    """Build the model of ``spec`` (see the module docstring) with weights from ``seed``."""
    from .models import PRESETS

    if not isinstance(spec, str) or not spec:
        raise ModelSpecError(f"model spec {spec!r}: expected {FORMS}")
    args = parse_model_args(model_args)
    _check_sizes(args, f"model spec {spec!r}")
    _positive("batch_size", batch_size, spec)
    _positive("seq_len", seq_len, spec)
    torch_dtype = _dtype(dtype)
    target, fake_mode = _target(device)
    is_preset = spec in PRESETS
    if not is_preset and not spec.startswith("hf:") and not _FACTORY.match(spec):
        raise ModelSpecError(f"model spec {spec!r}: unknown; expected {FORMS}")

    with torch.random.fork_rng(devices=[]), _default_dtype(torch_dtype), _maybe(fake_mode):
        torch.manual_seed(seed)
        built = _build(spec, args, batch_size, seq_len, is_preset)
        if isinstance(built, ModelBundle):
            return built
        model, batch_size, seq_len, vocab = built
        model = _place(model, spec, device, target, torch_dtype, fake_mode)
    model.train()
    step = {}
    if spec.startswith("hf:") and spec[3:] in HF_HEADS:
        step = dict(zip(("batch_fn", "loss_fn"), _hf_step(spec[3:], vocab, batch_size, seq_len, target, fake_mode)))
    return ModelBundle(
        model=model, spec=spec, batch_size=batch_size, seq_len=seq_len, dtype=torch_dtype, device=target,
        vocab_size=vocab, fake_mode=fake_mode, **step,
    )
