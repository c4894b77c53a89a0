"""The batch ``torchplace estimate DIR`` runs a transformers model's step on, by what the model
takes: its ``main_input_name`` (token ids, an image's ``pixel_values``, a waveform's
``input_values``, a spectrogram's ``input_features``), the decoder's tokens of an
encoder-decoder, and for training the labels its head computes a loss from (else the step's
backward starts from the sum of its outputs, as ``estimate`` does)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Batch", "example_batch"]

Batch = Callable[[torch.device], dict[str, torch.Tensor]]

# Heads whose labels are token ids shaped as the (decoder's) tokens, and those that take one
# class per example.
_TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
_CLASS_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification")


def _takes(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _part(config: Any, name: str) -> Any:
    """``name`` of the config, or of its vision or audio part."""
    for holder in (config, getattr(config, "vision_config", None)):
        value = getattr(holder, name, None)
        if value is not None:
            return value
    return None


def _main_shape(config: Any, main: str, batch: int, seq: int) -> tuple[tuple[int, ...], str]:
    """The main input's shape, and what it is in words."""
    if main == "pixel_values":
        size = _part(config, "image_size") or 224
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = _part(config, "num_channels") or 3
        return (batch, channels, height, width), f"images of {height} x {width}"
    if main == "input_values":
        stride = math.prod(getattr(config, "conv_stride", None) or (1,))
        return (batch, seq * stride), f"{seq * stride} audio samples ({seq} frames)"
    if main == "input_features":
        bins = getattr(config, "num_mel_bins", None) or 80
        frames = 2 * getattr(config, "max_source_positions", 0) or seq
        if getattr(config, "input_feat_per_channel", None):  # Speech2Text: frames first
            feats = config.input_feat_per_channel * getattr(config, "input_channels", 1)
            return (batch, seq, feats), f"{seq} frames of {feats} features"
        return (batch, bins, frames), f"{frames} frames of {bins} mel bins"
    return (batch, seq), f"{seq} tokens of {main}"


def example_batch(
    model: nn.Module, config: Any, batch: int, seq: int, train: bool
) -> tuple[Batch, str]:
    """What to run ``model``'s step on (a callable that builds it on a device), and a line
    that says what it is."""
    main = str(getattr(model, "main_input_name", "input_ids") or "input_ids")
    takes = _takes(model)
    shape, said = _main_shape(config, main, batch, seq)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    decoder = bool(getattr(config, "is_encoder_decoder", False)) and "decoder_input_ids" in takes
    longest = getattr(config, "max_target_positions", None)
    dec_seq = min(seq, longest) if isinstance(longest, int) and longest > 0 else seq
    kind = type(model).__name__
    labels: tuple[int, ...] | None = None
    if train and "labels" in takes:
        if kind.endswith(_CLASS_HEADS):
            labels = (batch,)
        elif kind.endswith(_TOKEN_HEADS) and (decoder or main == "input_ids"):
            labels = (batch, dec_seq) if decoder else shape

    def build(dev: torch.device) -> dict[str, torch.Tensor]:
        floating = main != "input_ids"
        out = {main: torch.zeros(shape, dtype=dtype if floating else torch.long, device=dev)}
        if decoder:
            out["decoder_input_ids"] = torch.zeros(batch, dec_seq, dtype=torch.long, device=dev)
        if labels is not None:
            out["labels"] = torch.zeros(labels, dtype=torch.long, device=dev)
        return out

    return build, f"{batch} x {said}" + (f", {dec_seq} decoder tokens" if decoder else "")
