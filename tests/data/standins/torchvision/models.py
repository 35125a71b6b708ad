"""ResNet-50 as torchvision builds it (bottleneck v1.5), written from the architecture for tests."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

EXPANSION = 4  # a bottleneck's output has four times its width


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand, each with batch norm; the shortcut added
    in place before the last ReLU."""

    def __init__(self, inplanes: int, width: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * EXPANSION, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * EXPANSION)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else None
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if shortcut is None:
            shortcut = self.downsample(x)
        out += shortcut
        return self.relu(out)


class ResNet(nn.Module):
    """Stem (7x7/2 convolution, batch norm, ReLU, 3x3/2 max pool), four stages of bottlenecks,
    global average pool and a linear classifier."""

    def __init__(self, blocks: List[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(64, blocks[0], 1)
        self.layer2 = self._stage(128, blocks[1], 2)
        self.layer3 = self._stage(256, blocks[2], 2)
        self.layer4 = self._stage(512, blocks[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * EXPANSION, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(self, width: int, count: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != width * EXPANSION:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, width * EXPANSION, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(width * EXPANSION))
        layers = [Bottleneck(self.inplanes, width, stride, downsample)]
        self.inplanes = width * EXPANSION
        layers += [Bottleneck(self.inplanes, width) for _ in range(1, count)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50: stages of 3, 4, 6 and 3 bottlenecks."""
    return ResNet([3, 4, 6, 3], num_classes=num_classes)
