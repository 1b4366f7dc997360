"""PyTorch counterparts of `finetune.models`' from-scratch models: what `dpprobe export` turns a
fine-tuned cnn, cnn_cifar, wrn16_4 or ScatterNet model into; the golden tests compare logits with
them, `benchmarks/finetune.py` trains them with Opacus. NCHW input, already normalized."""

import torch
import torch.nn.functional as F

__all__ = ["TorchCifarCNN", "TorchScatterCNN", "TorchTemperedCNN", "TorchWRN", "TorchWSConv"]


class TorchWSConv(torch.nn.Conv2d):
    """De et al.'s scaled weight standardization (jax_privacy's WSConv2D), padding (k-1)/2."""

    def __init__(self, cin, cout, k, stride=1):
        super().__init__(cin, cout, k, stride=stride, padding=(k - 1) // 2, bias=True)
        self.gain = torch.nn.Parameter(torch.ones(cout))

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        fan_in = w[0].numel()
        w = (w - mean) * torch.rsqrt(torch.clamp(fan_in * var, min=1e-4))
        return F.conv2d(x, w * self.gain.view(-1, 1, 1, 1), self.bias, self.stride, self.padding)


class TorchBlock(torch.nn.Module):
    def __init__(self, cin, cout, stride, project):
        super().__init__()
        self.norm1, self.conv1 = torch.nn.GroupNorm(16, cin), TorchWSConv(cin, cout, 3, stride)
        self.norm2, self.conv2 = torch.nn.GroupNorm(16, cout), TorchWSConv(cout, cout, 3)
        self.project = project
        if project:
            self.skip_norm = torch.nn.GroupNorm(16, cin)
            self.skip_conv = TorchWSConv(cin, cout, 1, stride)

    def forward(self, x):
        h = self.conv1(self.norm1(F.relu(x)))
        h = self.conv2(self.norm2(F.relu(h)))
        return h + (self.skip_conv(self.skip_norm(F.relu(x))) if self.project else x)


class TorchWRN(torch.nn.Module):
    def __init__(self, num_classes, depth, width, in_channels):
        super().__init__()
        n = (depth - 4) // 6
        self.stem = TorchWSConv(in_channels, 16, 3)
        blocks, c = [], 16
        for group, stride in enumerate((1, 2, 2)):
            for i in range(n):
                out = 16 * width * 2**group
                blocks.append(TorchBlock(c, out, stride if i == 0 else 1, i == 0))
                c = out
        self.blocks = torch.nn.ModuleList(blocks)
        self.final_norm = torch.nn.GroupNorm(16, c)
        self.head = torch.nn.Linear(c, num_classes)

    def features(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(F.relu(x)).mean(dim=(2, 3))

    def forward(self, x):
        return self.head(self.features(x))


class TorchTemperedCNN(torch.nn.Module):
    """Tramer & Boneh's MNIST_CNN (ftramer/Handcrafted-DP models.py)."""

    def __init__(self, num_classes, in_channels, side):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(in_channels, 16, 8, stride=2, padding=2)
        self.conv2 = torch.nn.Conv2d(16, 32, 4, stride=2)
        self.fc1 = torch.nn.Linear(32 * side * side, 32)
        self.head = torch.nn.Linear(32, num_classes)

    def features(self, x):
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2, 1)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2, 1)
        return torch.tanh(self.fc1(x.flatten(1)))

    def forward(self, x):
        return self.head(self.features(x))


class TorchCifarCNN(torch.nn.Module):
    """Tramer & Boneh's CIFAR10_CNN (ftramer/Handcrafted-DP models.py)."""

    def __init__(self, num_classes, in_channels, side):
        super().__init__()
        widths = (in_channels, 32, 32, 64, 64, 128, 128)
        pairs = zip(widths[:-1], widths[1:], strict=True)
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(a, b, 3, padding=1) for a, b in pairs)
        self.fc1 = torch.nn.Linear(128 * side * side, 128)
        self.head = torch.nn.Linear(128, num_classes)

    def features(self, x):
        for i, conv in enumerate(self.convs):
            x = torch.tanh(conv(x))
            if i % 2:
                x = F.max_pool2d(x, 2, 2)
        return torch.tanh(self.fc1(x.flatten(1)))

    def forward(self, x):
        return self.head(self.features(x))


class TorchScatterCNN(torch.nn.Module):
    """Tramer & Boneh's ScatterNet + CNN (ftramer/Handcrafted-DP models.py, `MNIST_CNN` on
    scattering), `finetune.models.ScatterCNN` on NCHW images in [0, 1]: ScatterNet (kymatio's
    torch Scattering2D, J = 2, L = 8; its filters are buffers, not parameters), GroupNorm(27)
    without affine, then the CNN; with `linear` (scatternet_cnn_linear) the head also reads
    the normalized ScatterNet output, flattened in NHWC order as dpprobe's."""

    def __init__(self, num_classes, in_channels, image_size, linear=False):
        super().__init__()
        from kymatio.torch import Scattering2D

        self.scattering = Scattering2D(J=2, shape=(image_size, image_size), L=8)
        side = (image_size // 4 + 1) // 2
        self.linear = linear
        self.conv1 = torch.nn.Conv2d(81 * in_channels, 16, 3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * side * side, 32)
        linear_inputs = 81 * in_channels * (image_size // 4) ** 2 if linear else 0
        self.head = torch.nn.Linear(32 + linear_inputs, num_classes)

    def features(self, x):
        s = self.scattering(x.contiguous())
        s = F.group_norm(s.reshape(s.shape[0], -1, s.shape[-2], s.shape[-1]), 27, eps=1e-5)
        x = torch.tanh(self.conv2(torch.tanh(self.conv1(s))))
        x = torch.tanh(self.fc1(x.flatten(1)))
        if self.linear:
            x = torch.cat([x, s.permute(0, 2, 3, 1).flatten(1)], dim=1)
        return x

    def forward(self, x):
        return self.head(self.features(x))
