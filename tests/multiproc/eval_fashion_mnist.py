#!/usr/bin/python3
"""Cross-check for ddp-train: load its model_state.pt with Debian's python3-torch, rebuild the
same network in torch.nn, evaluate it on the first N Fashion-MNIST test images (read from the
IDX .gz files directly) and print "correct C total T". Never part of the library.

usage: eval_fashion_mnist.py MODEL(mlp|cnn) model_state.pt DATA_DIR N
"""
import gzip
import struct
import sys

import numpy as np
import torch
from torch import nn

MEAN, STD = 0.2860, 0.3530  # ddp::kFashionMnistMean / kFashionMnistStd


def read_idx(path):
    with gzip.open(path, "rb") as f:
        magic, count = struct.unpack(">II", f.read(8))
        if magic == 2051:
            rows, cols = struct.unpack(">II", f.read(8))
            return np.frombuffer(f.read(), dtype=np.uint8).reshape(count, 1, rows, cols)
        return np.frombuffer(f.read(), dtype=np.uint8)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 256), nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc3(torch.relu(self.fc2(x)))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 32, 3), nn.BatchNorm2d(32)
        self.conv2, self.bn2 = nn.Conv2d(32, 64, 3), nn.BatchNorm2d(64)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.max_pool2d(x, 2).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    model_name, state_path, data_dir, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    net = {"mlp": Mlp, "cnn": Cnn}[model_name]()
    # PyTorch 2.6's torch.load is weights_only by default, and LibTorch's pickle_save tags the
    # {name: tensor} dict with torch.jit._pickle.restore_type_tag: allow exactly that function.
    if hasattr(torch.serialization, "add_safe_globals"):
        from torch.jit._pickle import restore_type_tag
        torch.serialization.add_safe_globals([restore_type_tag])
    net.load_state_dict(torch.load(state_path))  # strict: every name and shape must match
    net.eval()
    images = read_idx(f"{data_dir}/t10k-images-idx3-ubyte.gz")[:n]
    labels = read_idx(f"{data_dir}/t10k-labels-idx1-ubyte.gz")[:n]
    x = (torch.from_numpy(images.astype(np.float32)) / 255.0 - MEAN) / STD
    with torch.no_grad():
        correct = int((net(x).argmax(1) == torch.from_numpy(labels.astype(np.int64))).sum())
    print(f"correct {correct} total {len(labels)}")


if __name__ == "__main__":
    main()
