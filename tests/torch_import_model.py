"""tests/torch_import_model.py - a residual CNN defined in PyTorch for the
interop suite's scripts/torch_import.py test: a stem, a residual block, a
strided block with a 1x1 shortcut, global average pooling and a dense head;
batch norms with non-trivial statistics. make() is the factory; bad() a model
with a layer qtrain cannot express."""
import torch, torch.nn as nn
class Block(nn.Module):
    def __init__(self, c, out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c, out, 3, stride, 1, bias=False); self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False); self.bn2 = nn.BatchNorm2d(out)
        self.short = nn.Conv2d(c, out, 1, stride) if stride != 1 or c != out else None
        self.relu = nn.ReLU()
    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        s = self.short(x) if self.short is not None else x
        return torch.relu(y + s)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = Block(8, 8, 1); self.layer2 = Block(8, 16, 2)
        self.pool = nn.AdaptiveAvgPool2d(1); self.fc = nn.Linear(16, 10)
    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))
def make():
    torch.manual_seed(0)
    m = Net()
    g = torch.Generator().manual_seed(1)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
            mod.weight.data.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
            mod.bias.data.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
            mod.num_batches_tracked.fill_(7)
    return m


class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.fc = nn.Linear(4 * 56 * 56, 10)
    def forward(self, x):
        return self.fc(torch.flatten(self.up(self.conv(x)), 1))
def bad():
    return Bad()


class Bad2(nn.Module):
    """A cumulative-average batch norm and an add with alpha: each named, nothing written."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.fc = nn.Linear(4 * 28 * 28, 10)
    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.fc(torch.add(y, y, alpha=2).view(x.size(0), -1))
def bad2():
    return Bad2()
