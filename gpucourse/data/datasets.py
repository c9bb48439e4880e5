"""Offline data: a small, learnable, CIFAR-10-shaped dataset — and real CIFAR-10 when it is on disk.

The course never downloads anything. :class:`SyntheticCIFAR10` is generated from a seed in well
under a second and behaves like ``torchvision.datasets.CIFAR10``: 3×32×32 RGB images, 10 classes,
``.data`` as a ``(N, 32, 32, 3)`` uint8 array, ``.targets`` as a list of ints, items returned as PIL
images that go through ``transform`` — so the seeds' transforms (``RandomCrop(32, padding=4)``,
``ToTensor``, ``Normalize``) work unchanged.

How it is made learnable: every class has a *prototype* image (a few coloured waves with a class's
own frequencies and orientation). A sample is its class prototype, shifted by a few pixels, with
random brightness, a faint trace of another class's prototype and pixel noise. A small conv net
learns it in a couple of epochs, so loss curves really go down, but not to zero at once.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from ..runtime import check_int

__all__ = ["SyntheticCIFAR10", "load_cifar10", "cifar10_or_synthetic", "CIFAR10_CLASSES"]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")


def _prototypes(generator: torch.Generator) -> torch.Tensor:
    """10 class prototype images, (10, 3, 32, 32) in [0, 1]."""
    ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    protos = torch.zeros(10, 3, 32, 32)
    for c in range(10):
        for _wave in range(3):
            angle = (c / 10 + torch.rand((), generator=generator).item() * 0.1) * math.pi
            freq = 2 * math.pi * (1 + (c % 5) + torch.rand((), generator=generator).item()) / 32
            phase = torch.rand((), generator=generator).item() * 2 * math.pi
            wave = torch.sin(freq * (xs * math.cos(angle) + ys * math.sin(angle)) + phase)
            colour = torch.rand(3, generator=generator)
            protos[c] += colour[:, None, None] * wave
    protos -= protos.amin(dim=(1, 2, 3), keepdim=True)
    protos /= protos.amax(dim=(1, 2, 3), keepdim=True)
    return protos


class SyntheticCIFAR10(Dataset):
    """A generated stand-in for ``torchvision.datasets.CIFAR10``: same shapes, same API, offline.

    Args:
        root: ignored; accepted so code written for ``CIFAR10(root, ...)`` runs unchanged.
        train: the training split (``size`` defaults to 5000) or the test split (1000).
        transform: applied to the PIL image, as in torchvision (e.g. ``transforms.ToTensor()``).
        target_transform: applied to the integer label.
        download: ignored (nothing is ever downloaded).
        size: number of images.
        seed: the same seed gives the same images on every machine; train and test splits of
            one seed share the class prototypes but not the samples.

    Example::

        >>> ds = SyntheticCIFAR10(size=100)
        >>> len(ds), ds.data.shape, ds.data.dtype, ds.classes[3]
        (100, (100, 32, 32, 3), dtype('uint8'), 'cat')
        >>> image, label = ds[0]            # a PIL image, like torchvision's CIFAR10
        >>> image.size, image.mode, 0 <= label < 10
        ((32, 32), 'RGB', True)
        >>> x, y = ds.tensors()             # everything at once, as float tensors in [0, 1]
        >>> tuple(x.shape), tuple(y.shape)
        ((100, 3, 32, 32), (100,))
    """

    classes = list(CIFAR10_CLASSES)

    def __init__(self, root: str | None = None, train: bool = True, transform=None,
                 target_transform=None, download: bool = False, *, size: int | None = None,
                 seed: int = 0):
        del root, download
        if size is None:
            size = 5000 if train else 1000
        check_int("size", size, 1)
        self.train = train
        self.transform = transform
        self.target_transform = target_transform
        g = torch.Generator().manual_seed(seed)
        protos = _prototypes(g)
        g.manual_seed(seed * 2 + (0 if train else 1) + 1_000_003)  # split-specific samples
        targets = torch.randint(0, 10, (size,), generator=g)
        images = protos[targets]
        # a few pixels of translation, like the random crops of real photos
        shifts = torch.randint(-4, 5, (size, 2), generator=g)
        rows = (torch.arange(32) - shifts[:, :1]) % 32               # (N, 32): a roll per image
        cols = (torch.arange(32) - shifts[:, 1:]) % 32
        images = images[torch.arange(size)[:, None, None, None], torch.arange(3)[None, :, None, None],
                        rows[:, None, :, None], cols[:, None, None, :]]
        other = protos[torch.randint(0, 10, (size,), generator=g)]
        images = 0.65 * images + 0.35 * other                      # a trace of another class
        images = images * (0.5 + torch.rand(size, 1, 1, 1, generator=g))     # brightness
        images = images + 0.25 * torch.randn(images.shape, generator=g)      # sensor noise
        images = images.clamp(0, 1)
        self.data = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        self.targets = targets.tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        from PIL import Image

        image = Image.fromarray(self.data[index])
        target = self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All images as a float tensor ``(N, 3, 32, 32)`` in [0, 1] and labels ``(N,)`` (no transform)."""
        x = torch.from_numpy(np.ascontiguousarray(self.data)).permute(0, 3, 1, 2).float() / 255
        return x, torch.tensor(self.targets)

    def __repr__(self) -> str:
        split = "train" if self.train else "test"
        return f"SyntheticCIFAR10(split={split}, size={len(self)})"


def load_cifar10(root: str | os.PathLike = "data", train: bool = True, transform=None):
    """The real CIFAR-10 from ``root`` through torchvision — never downloaded by the course.

    Args:
        root: the folder holding ``cifar-10-batches-py``.
        train: the 50,000 training images, or the 10,000 test images.
        transform: a torchvision transform applied to each PIL image.

    Example::

        >>> try:
        ...     load_cifar10("/nonexistent")
        ... except FileNotFoundError as e:
        ...     print(str(e).split(" (")[0])
        CIFAR-10 was not found under '/nonexistent'

    Raises:
        FileNotFoundError: CIFAR-10 is not under ``root``; the message says how to get it.
    """
    from torchvision.datasets import CIFAR10

    try:
        return CIFAR10(root=os.fspath(root), train=train, transform=transform, download=False)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted."
        raise FileNotFoundError(
            f"CIFAR-10 was not found under {os.fspath(root)!r} ({e}). The course never downloads "
            "data. To use the real dataset, fetch it once on a machine with internet "
            "(torchvision.datasets.CIFAR10(root, download=True)) and copy the "
            "'cifar-10-batches-py' folder there; otherwise use SyntheticCIFAR10()."
        ) from None


def cifar10_or_synthetic(root: str | os.PathLike = "data", train: bool = True, transform=None, *,
                         size: int | None = None, seed: int = 0, verbose: bool = True):
    """Real CIFAR-10 if it is under ``root``, else :class:`SyntheticCIFAR10` (saying which).

    Example::

        >>> ds = cifar10_or_synthetic("/nonexistent", size=50)
        using SyntheticCIFAR10 (50 images): no CIFAR-10 under '/nonexistent'
        >>> len(ds)
        50
    """
    try:
        ds = load_cifar10(root, train=train, transform=transform)
    except FileNotFoundError:
        ds = SyntheticCIFAR10(train=train, transform=transform, size=size, seed=seed)
        if verbose:
            print(f"using SyntheticCIFAR10 ({len(ds)} images): no CIFAR-10 under {os.fspath(root)!r}")
        return ds
    if verbose:
        print(f"using real CIFAR-10 from {os.fspath(root)!r} ({len(ds)} images)")
    return ds
