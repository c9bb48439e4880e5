"""What the course trains: offline datasets and the small models every chapter shares.

- ``datasets``  a learnable CIFAR-10-shaped dataset generated offline; real CIFAR-10 when on disk
- ``models``    the seeds' ``Net``, ``SmallConvNet``, ``MLP``, ``ToyModel``
- ``transformer`` ``TinyGPT``, the small GPT chapters 09–12 split (plain PyTorch, no splitting here)
- ``text``        ``TinyText``, the generated text TinyGPT learns (offline, character-level)
"""

from .datasets import CIFAR10_CLASSES, SyntheticCIFAR10, cifar10_or_synthetic, load_cifar10
from .models import MLP, Net, SmallConvNet, ToyModel
from .text import TinyText
from .transformer import CausalSelfAttention, FeedForward, TinyGPT, TransformerBlock

__all__ = ["CIFAR10_CLASSES", "SyntheticCIFAR10", "cifar10_or_synthetic", "load_cifar10",
           "MLP", "Net", "SmallConvNet", "ToyModel", "TinyText", "CausalSelfAttention", "FeedForward",
           "TinyGPT", "TransformerBlock"]
