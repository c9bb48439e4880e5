"""What the course trains: offline datasets and the small models every chapter shares.

- ``datasets``  a learnable CIFAR-10-shaped dataset generated offline; real CIFAR-10 when on disk
- ``models``    the seeds' ``Net``, ``SmallConvNet``, ``MLP``, ``ToyModel``
"""

from .datasets import CIFAR10_CLASSES, SyntheticCIFAR10, cifar10_or_synthetic, load_cifar10
from .models import MLP, Net, SmallConvNet, ToyModel

__all__ = ["CIFAR10_CLASSES", "SyntheticCIFAR10", "cifar10_or_synthetic", "load_cifar10",
           "MLP", "Net", "SmallConvNet", "ToyModel"]
