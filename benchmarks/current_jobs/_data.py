"""Synthetic data in the shapes the corpus's scripts read (the real ones download a dataset)."""

import random


def sentences(n: int, words: int = 120, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(4000)}" for _ in range(rng.randint(words // 2, words))) for _ in range(n)]
