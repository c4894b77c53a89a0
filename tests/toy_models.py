"""Models and fake CUDA devices shared by the estimate, plan and dispatch tests."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

CPU, META = torch.device("cpu"), torch.device("meta")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)

LINEAR_BYTES = (16 * 16 + 16) * 4  # nn.Linear(16, 16) in float32: 1088 bytes


# --- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    """A residual block: its own forward adds its input to its children's output.

    The sum goes through torch.cat, which refuses a cpu/meta mix (a plain + lets it through).
    """

    def __init__(self, width: int = 16, device: str | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(width, width, device=device)
        self.b = nn.Linear(width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.b(torch.relu(self.a(x)))]).view(2, *x.shape).sum(0)


class Net(nn.Module):
    """Embedding-like input layer, a stack of blocks and a head."""

    def __init__(self, blocks: int = 3, device: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, device=device)
        self.blocks = nn.ModuleList(Block(device=device) for _ in range(blocks))
        self.head = nn.Linear(16, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedLM(nn.Module):
    """A language-model shape: the head shares the embedding's weight."""

    def __init__(self, vocab: int = 32, width: int = 16, device: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, device=device)
        self.body = nn.Sequential(*(nn.Linear(width, width, device=device) for _ in range(3)))
        self.lm_head = nn.Linear(width, vocab, device=device)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(tokens)))


def on_fake_cuda(model: nn.Module, placement: dict[str, str]) -> nn.Module:
    """Give a meta-built model fake parameters reporting CUDA devices (docs/design.md).

    Tied parameters stay tied: each parameter object is replaced once, everywhere it appears.
    """
    replaced: dict[int, nn.Parameter] = {}
    with FakeTensorMode():
        for prefix, dev in placement.items():
            for module in model.get_submodule(prefix).modules():
                for name, param in list(module._parameters.items()):
                    if param is None:
                        continue
                    if id(param) not in replaced:
                        fake = torch.empty(param.shape, dtype=param.dtype, device=dev)
                        replaced[id(param)] = nn.Parameter(fake, requires_grad=False)
                    setattr(module, name, replaced[id(param)])
    return model
