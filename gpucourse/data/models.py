"""The small models the course trains: the seeds' CIFAR ``Net``, a wider ``SmallConvNet``, an MLP, and
the DDP tutorial's toy.

They are deliberately small so that every chapter trains them for real on a laptop CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import check_int

__all__ = ["Net", "SmallConvNet", "MLP", "ToyModel"]


class Net(nn.Module):
    """The seeds' CIFAR-10 network: conv → pool → conv → pool → fc → fc → fc (62k parameters).

    Example::

        >>> import torch
        >>> net = Net()
        >>> net(torch.zeros(4, 3, 32, 32)).shape          # (B, 3, 32, 32) -> (B, 10) logits
        torch.Size([4, 10])
        >>> sum(p.numel() for p in net.parameters())
        62006
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)        # (B, 3, 32, 32) -> (B, 6, 28, 28) -> pool 14x14
        self.conv2 = nn.Conv2d(6, 16, 5)       # (B, 6, 14, 14) -> (B, 16, 10, 10) -> pool 5x5
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)                # the seeds' x.view(-1, 400), safe for any batch
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class SmallConvNet(nn.Sequential):
    """The seeds' CIFAR network with wider convolutions (32 and 64 channels instead of 6 and 16).

    conv(3→32, 5) → ReLU → pool → conv(32→64, 5) → ReLU → pool → fc 1600→120 → fc 120→84 → fc 84→10
    (0.26 M parameters). Chapters 02–03 and ``benchmarks/data_parallel.py`` measure DataParallel
    on it: each of its operations is large enough that computing rows, not DataParallel's fixed
    per-step overhead, fills a training step — unlike :class:`Net`, whose operations are tiny.

    Args:
        c1, c2: channels of the two convolutions.
        num_classes: outputs.

    Example::

        >>> import torch
        >>> net = SmallConvNet()
        >>> net(torch.zeros(4, 3, 32, 32)).shape          # (B, 3, 32, 32) -> (B, 10) logits
        torch.Size([4, 10])
        >>> sum(p.numel() for p in net.parameters())
        256830

    .. warning::
        Like :class:`Net` it expects 32×32 inputs (CIFAR-10); other sizes fail at the first
        ``Linear`` with a shape error.
    """

    def __init__(self, c1: int = 32, c2: int = 64, num_classes: int = 10):
        for name, value in (("c1", c1), ("c2", c2), ("num_classes", num_classes)):
            check_int(name, value, 1)
        super().__init__(nn.Conv2d(3, c1, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c1, c2, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(c2 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                         nn.Linear(84, num_classes))


class MLP(nn.Sequential):
    """Linear → ReLU → … → Linear. A ``nn.Sequential``, so it can also be split into pipeline stages.

    Args:
        sizes: layer widths, input first: ``MLP(32, 64, 10)`` is 32 → 64 → ReLU → 10.

    Example::

        >>> import torch
        >>> mlp = MLP(32, 64, 10)
        >>> mlp(torch.zeros(5, 32)).shape
        torch.Size([5, 10])
        >>> mlp[:2]                          # slices are MLPs too (e.g. pipeline stages)
        MLP(
          (0): Linear(in_features=32, out_features=64, bias=True)
          (1): ReLU()
        )
    """

    def __init__(self, *sizes: int):
        if len(sizes) == 1 and isinstance(sizes[0], dict):
            # nn.Sequential slicing (mlp[1:3]) rebuilds the class from an OrderedDict of layers
            super().__init__(sizes[0])
            return
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output size, got {sizes}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"MLP sizes must be positive ints, got {sizes}")
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class ToyModel(nn.Module):
    """PyTorch's DDP tutorial model: Linear(10, 10) → ReLU → Linear(10, 5).

    Example::

        >>> import torch
        >>> ToyModel()(torch.zeros(20, 10)).shape
        torch.Size([20, 5])
    """

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))
