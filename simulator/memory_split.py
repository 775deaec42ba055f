"""Persistent and ephemeral memory of a simulated job, for Salus' lane admission.

Why a function of the workload: traces give one number per job (its peak), Salus needs two. Until the
estimator reports measured values, the split is a persistent fraction of the peak by model family (our
assumption, docs/simulator.md): Salus §2.2 measures persistent memory of 110.9 MB (googlenet_25) to
822.2 MB (resnet152_75) for CNNs whose peaks are several GB, i.e. about a tenth; language models keep
optimizer state as large as the weights several times over, so a larger share is persistent; the small
CIFAR models' peaks are so low that framework-internal memory weighs more. Swap ``PERSISTENT_FRACTION``
or pass another ``splitter`` to the Salus simulation to change it.
"""

from __future__ import annotations

from collections.abc import Callable

from gpushare.gpus import GiB
from gpushare.simulator.trace import JobSpec

PERSISTENT_FRACTION: dict[str, float] = {
    "language": 0.35,  # xlnet, BERT, gpt2: parameters + gradients + Adam moments
    "cifar": 0.15,  # small CIFAR models: peaks under 1 GB, framework-internal memory weighs more
    "vision": 0.10,  # ImageNet CNNs: Salus §2.2, 0.1–0.8 GB persistent against multi-GB peaks
    "other": 0.20,  # UNet, MaskRCNN, DLRM, custom jobs
}
LANGUAGE = ("xlnet", "bert", "gpt2", "transformer", "llama")
CIFAR = ("_cifar", "resnet18", "resnet34", "mobilenetv3_small")
VISION = ("efficientnet", "resnet", "mobilenet", "vgg", "xception", "inception", "googlenet", "alexnet")

Splitter = Callable[[JobSpec], tuple[int, int]]


def family(model: str) -> str:
    """The family a model name belongs to, by name (first match of language, CIFAR, vision)."""
    name = model.lower()
    for label, needles in (("language", LANGUAGE), ("cifar", CIFAR), ("vision", VISION)):
        if any(needle in name for needle in needles):
            return label
    return "other"


def split(spec: JobSpec) -> tuple[int, int]:
    """(persistent bytes, ephemeral bytes) per GPU; they add up to the job's peak."""
    peak = int(spec.mem_gib * GiB)
    persistent = int(peak * PERSISTENT_FRACTION[family(spec.model)])
    return persistent, peak - persistent
