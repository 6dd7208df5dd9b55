"""``CIFAR10`` over the pickled batch folder ``<root>/cifar-10-batches-py`` (no download, no checksums)."""
from __future__ import annotations

import os
import pickle
from typing import Callable

import numpy as np
from PIL import Image

ROOT_OVERRIDE = "TORCHVISION_STANDIN_CIFAR10_ROOT"


class CIFAR10:
    base_folder = "cifar-10-batches-py"
    train_list = [f"data_batch_{i}" for i in range(1, 6)]
    test_list = ["test_batch"]
    meta_file = "batches.meta"

    def __init__(self, root: str, train: bool = True, transform: Callable | None = None,
                 target_transform: Callable | None = None, download: bool = False) -> None:
        self.root = os.environ.get(ROOT_OVERRIDE) or os.path.expanduser(str(root))
        self.train, self.transform, self.target_transform = train, transform, target_transform
        folder = os.path.join(self.root, self.base_folder)
        names = (self.train_list if train else self.test_list) + [self.meta_file]
        missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
        if missing:
            raise RuntimeError(f"CIFAR-10 batches missing in {folder}: {missing} (the torchvision stand-in does not "
                               f"download{'' if not download else ', even with download=True'})")
        data, targets = [], []
        for name in names[:-1]:
            with open(os.path.join(folder, name), "rb") as fh:
                entry = pickle.load(fh, encoding="latin1")
            data.append(entry["data"])
            targets.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
        self.targets = targets
        with open(os.path.join(folder, self.meta_file), "rb") as fh:
            self.classes = pickle.load(fh, encoding="latin1")["label_names"]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __getitem__(self, index: int) -> tuple[object, int]:
        img, target = Image.fromarray(self.data[index]), self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self) -> int:
        return len(self.data)
