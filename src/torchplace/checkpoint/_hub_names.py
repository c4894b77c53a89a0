"""What a checkpoint's names say without a model: Hugging Face hub names of fused experts.

transformers 5 saves MoE experts one tensor per expert (``mlp.experts.0.gate_proj.weight``),
while its models fuse them (``mlp.experts.gate_up_proj``); ``load_into`` converts them for a
transformers model (``_conversions``). ``torchplace inspect`` has no model, so it says only that
the names look like that layout. Needs no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["hub_names_note"]

_EXPERT = re.compile(r"\.experts\.\d+\.")


def hub_names_note(names: Iterable[str], /) -> str:
    """A sentence when ``names`` look like hub names of per-expert MoE tensors, else "".

    >>> hub_names_note(["model.layers.0.mlp.experts.3.down_proj.weight"])[:45]
    'model.layers.0.mlp.experts.3.down_proj.weight'
    >>> hub_names_note(["model.layers.0.mlp.experts.down_proj"])
    ''
    """
    example = next((n for n in names if _EXPERT.search(n)), None)
    if example is None:
        return ""
    return (
        f"{example} and names like it are Hugging Face hub names, one tensor per MoE expert; "
        "transformers 5 models hold each layer's experts fused in one tensor, and "
        "torchplace.load_into(model, path) fuses them as from_pretrained does"
    )
