import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision import transforms

import gpucourse as gc


def test_synthetic_cifar_is_deterministic_and_shaped():
    a, b = gc.SyntheticCIFAR10(size=64, seed=3), gc.SyntheticCIFAR10(size=64, seed=3)
    assert np.array_equal(a.data, b.data) and a.targets == b.targets
    assert a.data.shape == (64, 32, 32, 3) and a.data.dtype == np.uint8
    assert set(a.targets) <= set(range(10))
    c = gc.SyntheticCIFAR10(size=64, seed=4)
    assert not np.array_equal(a.data, c.data)


def test_train_and_test_splits_differ():
    tr, te = gc.SyntheticCIFAR10(size=32), gc.SyntheticCIFAR10(size=32, train=False)
    assert not np.array_equal(tr.data, te.data)
    assert len(gc.SyntheticCIFAR10(train=False)) == 1000


def test_torchvision_transforms_work_like_cifar10():
    tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    ds = gc.SyntheticCIFAR10(size=8, transform=tf, target_transform=lambda y: y + 100)
    x, y = ds[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 100 <= y < 110
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    xb, yb = next(iter(loader))
    assert xb.shape == (4, 3, 32, 32)


def test_synthetic_cifar_is_learnable_but_not_trivial():
    torch.manual_seed(0)
    x, y = gc.SyntheticCIFAR10(size=2000).tensors()
    xt, yt = gc.SyntheticCIFAR10(train=False, size=500).tensors()
    net = gc.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    acc_before = (net((xt - 0.5) / 0.5).argmax(1) == yt).float().mean().item()
    for _ in range(3):
        for i in range(0, len(y), 64):
            loss = F.cross_entropy(net((x[i:i + 64] - 0.5) / 0.5), y[i:i + 64])
            opt.zero_grad()
            loss.backward()
            opt.step()
    acc = (net((xt - 0.5) / 0.5).argmax(1) == yt).float().mean().item()
    assert acc_before < 0.3 and acc > 0.6, (acc_before, acc)


def test_bad_size():
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        gc.SyntheticCIFAR10(size=0)


def test_load_cifar10_missing_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        gc.load_cifar10(tmp_path)


def test_models_shapes_and_grads():
    net = gc.Net()
    out = net(torch.randn(3, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (3, 10) and all(p.grad is not None for p in net.parameters())
    mlp = gc.MLP(8, 16, 16, 4)
    assert [type(m).__name__ for m in mlp] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    with pytest.raises(ValueError):
        gc.MLP(8)
    assert gc.ToyModel()(torch.randn(2, 10)).shape == (2, 5)


def test_mlp_slices_share_layers():
    mlp = gc.MLP(4, 8, 8, 2)
    head, tail = mlp[:2], mlp[2:]
    assert head[0] is mlp[0] and tail[-1] is mlp[-1]
    x = torch.randn(3, 4)
    torch.testing.assert_close(tail(head(x)), mlp(x))


def test_small_conv_net_is_the_wider_net():
    torch.manual_seed(0)
    net = gc.SmallConvNet()
    convs = [m for m in net if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(3, 32, (5, 5)), (32, 64, (5, 5))]
    x = torch.randn(3, 3, 32, 32, requires_grad=True)
    out = net(x)
    assert out.shape == (3, 10)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    assert gc.SmallConvNet(8, 16, 4)(x).shape == (3, 4)
    with pytest.raises(ValueError, match="c1 must be >= 1, got 0"):
        gc.SmallConvNet(0)
