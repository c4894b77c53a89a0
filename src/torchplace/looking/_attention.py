"""``scaled_dot_product_attention`` measured as the device it stands for would run it.

On a CPU or CUDA tensor, PyTorch picks one of its fused kernels where the arguments allow, and
a fused kernel never holds the (batch, heads, seq, seq) attention matrix: it keeps the output
and a float32 log-sum-exp per query for the backward. On ``meta`` no kernel is picked and the
math path runs, which makes that matrix (its softmax and, in training, more copies), so a
skeleton's attention was sized tens of times too big at long sequences. While a step runs on
``meta``, this mode calls the fused kernel the target device would pick, whose meta kernel
shapes what it holds, and leaves the math path where that device would run it too.

The rules are PyTorch's dispatch (``sdp_utils``), as its documentation and source state them:

- CPU (and a skeleton on ``meta``, measured as a CPU runs it): the flash kernel for 4-d query,
  key and value of one head size in float32/64, bfloat16 or float16, with or without a mask,
  causal or not, grouped-query where this torch's CPU kernel takes it (torch 2.6's does not);
  the math path with dropout, or with a mask that requires grad (a learned bias: T5's, Doge's,
  SAM's), which the flash kernel cannot differentiate.
- CUDA (taken to be sm80 or later): the flash kernel for float16/bfloat16 without a mask, one
  head size of at most 256; else the memory-efficient kernel (float32 too, with a mask, query
  and key of one head size, head sizes a multiple of 8 elements in 16-bit dtypes, of 4 in
  float32; not grouped-query, which PyTorch runs on flash or the math path only); else the
  math path. On either, a 3-d mask, no queries or keys, or a batch broadcast between query, key
  and value take the math path, as PyTorch's own choice does.
  cuDNN attention, which PyTorch puts first on sm90/sm100 with a recent cuDNN, holds what flash
  holds (the output and a float32 statistic per query) and is not told apart.

A boolean mask is turned into an additive one in the query's dtype first, as PyTorch does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["FusedAttention"]

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_FLASH_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_EFFICIENT_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict[str, Any]:
    found = {"q": query, "k": key, "v": value, "mask": attn_mask, "dropout": dropout_p}
    return {**found, "causal": is_causal, "scale": scale, "gqa": enable_gqa}


def _kernel(target: torch.device, a: dict[str, Any]) -> str:
    """Which kernel ``target`` runs for these arguments: "cpu", "flash", "efficient", "math"."""
    q, k, v = a["q"], a["k"], a["v"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "math"
    if len({q.dtype, k.dtype, v.dtype}) > 1 or any(t.stride(-1) != 1 for t in (q, k, v)):
        return "math"
    same_heads = q.shape[1] == k.shape[1] == v.shape[1]
    if not same_heads and not a["gqa"]:
        return "math"  # the math path raises for it, as the fused ones do
    mask = a["mask"]
    if (mask is not None and mask.dim() not in (2, 4)) or 0 in (q.shape[-2], k.shape[-2]):
        return "math"  # a 3-d mask, no queries or keys: the fused kernels refuse them
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return "math"  # a batch broadcast across query, key and value
    if target.type != "cuda":
        one_size = q.shape[-1] == k.shape[-1] == v.shape[-1]
        takes = same_heads or _cpu_flash_takes_grouped_query()
        plain = not a["dropout"] and not (mask is not None and mask.requires_grad)
        return "cpu" if q.dtype in _CPU_DTYPES and one_size and takes and plain else "math"
    if (
        q.dtype in _FLASH_CUDA_DTYPES
        and a["mask"] is None
        and q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256
    ):
        return "flash"
    if not same_heads:
        return "math"  # grouped-query runs on flash or the math path only, on CUDA
    align = 8 if q.dtype in _FLASH_CUDA_DTYPES else 4  # elements, on sm80 and later
    if (
        q.dtype in _EFFICIENT_CUDA_DTYPES
        and q.shape[-1] == k.shape[-1]
        and q.shape[-1] % align == 0
        and v.shape[-1] % align == 0
    ):
        return "efficient"
    return "math"


@functools.cache
def _cpu_flash_takes_grouped_query() -> bool:
    """Whether this torch's CPU flash kernel takes grouped-query attention (torch 2.6's does
    not: it runs the math path), as its own choice of kernel says for a tiny call."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # real CPU tensors, with every kernel allowed, whatever the caller's context (a fake step
    # begun, ``with torch.device("meta")``, an ``sdpa_kernel`` of its own): the answer is kept
    every = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with unset_fake_temporarily(), sdpa_kernel(every):
        q = torch.zeros(1, 2, 4, 8, device="cpu")
        kv = torch.zeros(1, 1, 4, 8, device="cpu")
        try:
            choice = torch._fused_sdp_choice(q, kv, kv, enable_gqa=True)
        except (AttributeError, RuntimeError, TypeError):  # a torch without it, or without gqa
            return False
    return bool(choice != 0)  # 0: the math path


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as PyTorch gives it to the fused kernels: 0 where kept, -inf where not."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    kept = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, kept, torch.full_like(kept, float("-inf")))


def _fused(kernel: str, a: dict[str, Any]) -> torch.Tensor:
    aten = torch.ops.aten
    q, k, v, scale = a["q"], a["k"], a["v"], a["scale"]
    if kernel == "cpu":
        mask = _additive(a["mask"], q.dtype)
        out = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, a["dropout"], a["causal"], attn_mask=mask, scale=scale
        )
    elif kernel == "flash":
        out = aten._scaled_dot_product_flash_attention(
            q, k, v, a["dropout"], a["causal"], False, scale=scale
        )
    else:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        mask = _additive(a["mask"], q.dtype)
        out = aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, grad, a["dropout"], a["causal"], scale=scale
        )
    result: torch.Tensor = out[0]
    return result


class FusedAttention(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` runs the fused kernel ``target`` would
    pick (see the module docstring)."""

    def __init__(self, target: torch.device) -> None:
        super().__init__()
        self.target = target
        _cpu_flash_takes_grouped_query()  # asked now, with real tensors, before the fake step

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            try:
                found = _arguments(*args, **kwargs)
            except TypeError:  # not as documented: as torch takes it
                return func(*args, **kwargs)
            kernel = _kernel(self.target, found)
            if kernel != "math":
                return _fused(kernel, found)
        return func(*args, **kwargs)
