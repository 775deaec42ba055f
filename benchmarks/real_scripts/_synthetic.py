"""Synthetic data in the on-disk formats real training scripts read, made at run time in a temporary
directory: token memmaps (nanoGPT's ``train.bin``), idx files (MNIST), image folders (ImageNet layout),
plain-text corpora. Nothing is downloaded."""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np


def workdir(name: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"gpushare-corpus-{os.getuid()}", name)
    os.makedirs(path, exist_ok=True)
    return path


def token_memmap(name: str, tokens: int, vocab: int) -> str:
    path = os.path.join(workdir(name), "train.bin")
    if not os.path.exists(path) or os.path.getsize(path) != tokens * 2:
        data = np.random.default_rng(0).integers(0, vocab, tokens, dtype=np.uint16)
        data.tofile(path)
    return path


def idx_files(name: str, n: int, rows: int = 28, cols: int = 28) -> tuple[str, str]:
    base = workdir(name)
    images, labels = os.path.join(base, "train-images-idx3-ubyte"), os.path.join(base, "train-labels-idx1-ubyte")
    if not os.path.exists(labels):
        rng = np.random.default_rng(0)
        with open(images, "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, rows, cols))
            f.write(rng.integers(0, 256, n * rows * cols, dtype=np.uint8).tobytes())
        with open(labels, "wb") as f:
            f.write(struct.pack(">II", 2049, n))
            f.write(rng.integers(0, 10, n, dtype=np.uint8).tobytes())
    return images, labels


def read_idx(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = struct.unpack(">" + "I" * (magic & 0xFF), f.read(4 * (magic & 0xFF)))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(dims)


def image_folder(name: str, classes: int, per_class: int, size: int = 64) -> str:
    from PIL import Image

    root = os.path.join(workdir(name), "train")
    marker = os.path.join(root, ".done")
    if not os.path.exists(marker):
        rng = np.random.default_rng(0)
        for c in range(classes):
            d = os.path.join(root, f"n{c:08d}")
            os.makedirs(d, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                    os.path.join(d, f"{i}.png"))
        open(marker, "w").close()
    return root


def text_corpus(name: str, words: int, vocab: int = 5000) -> str:
    path = os.path.join(workdir(name), "train.txt")
    if not os.path.exists(path):
        rng = np.random.default_rng(0)
        lexicon = [f"w{i}" for i in range(vocab)]
        ids = rng.zipf(1.3, words) % vocab
        with open(path, "w") as f:
            for start in range(0, words, 20):
                f.write(" ".join(lexicon[i] for i in ids[start:start + 20]) + "\n")
    return path
