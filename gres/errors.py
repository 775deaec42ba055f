"""``GpuError``: the one exception the device interface raises, carrying NVML's own error code.

Why NVML's codes and not our own taxonomy (docs/style.md #3): the MIG executor and the agent decide what to do
from the code (INSUFFICIENT_RESOURCES → the placement is taken, IN_USE → try again once the GPU is idle,
GPU_IS_LOST → drain the node), and both backends must produce the same codes for the same situation so
that code tested on the simulated backend behaves the same on a real GPU. Values are NVML's
(``nvml.h``: ``NVML_ERROR_*``), so a code read from a log matches NVIDIA's documentation.
"""

from __future__ import annotations

from enum import IntEnum

from gpushare.errors import GpushareError


class NvmlCode(IntEnum):
    """NVML return codes (``nvmlReturn_t``), same names without the ``NVML_ERROR_`` prefix."""

    UNINITIALIZED = 1
    INVALID_ARGUMENT = 2
    NOT_SUPPORTED = 3
    NO_PERMISSION = 4
    ALREADY_INITIALIZED = 5
    NOT_FOUND = 6
    INSUFFICIENT_SIZE = 7
    INSUFFICIENT_POWER = 8
    DRIVER_NOT_LOADED = 9
    TIMEOUT = 10
    IRQ_ISSUE = 11
    LIBRARY_NOT_FOUND = 12
    FUNCTION_NOT_FOUND = 13
    CORRUPTED_INFOROM = 14
    GPU_IS_LOST = 15
    RESET_REQUIRED = 16
    OPERATING_SYSTEM = 17
    LIB_RM_VERSION_MISMATCH = 18
    IN_USE = 19
    MEMORY = 20
    NO_DATA = 21
    INSUFFICIENT_RESOURCES = 23
    ARGUMENT_VERSION_MISMATCH = 25
    DEPRECATED = 26
    NOT_READY = 27
    GPU_NOT_FOUND = 28
    INVALID_STATE = 29
    UNKNOWN = 999

    @classmethod
    def parse(cls, value: "str | int | NvmlCode") -> "NvmlCode":
        """Accept ``"GPU_IS_LOST"``, ``"NVML_ERROR_GPU_IS_LOST"``, ``15`` or a member (scenario files)."""
        if isinstance(value, NvmlCode):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                return cls.UNKNOWN
        if isinstance(value, str):
            key = value.strip().upper().removeprefix("NVML_ERROR_")
            if key in cls.__members__:
                return cls[key]
        known = ", ".join(cls.__members__)
        raise ValueError(f"unknown NVML error {value!r}; known: {known}")


class GpuError(GpushareError):
    """A real device fault or a refused operation, with NVML's code.

    ``code`` is an :class:`NvmlCode`; ``str(err)`` reads ``"<what we tried>: NVML_ERROR_<NAME> (<n>)"``
    followed by a hint when we know the fix. Callers branch on ``err.code`` (or the ``is_*`` helpers),
    never on the message.
    """

    def __init__(self, code: "NvmlCode | int | str", message: str = "") -> None:
        self.code = NvmlCode.parse(code)
        self.detail = message
        super().__init__(self.__str__())

    @property
    def name(self) -> str:
        return self.code.name

    def __str__(self) -> str:
        head = f"{self.detail}: " if self.detail else ""
        return f"{head}NVML_ERROR_{self.code.name} ({int(self.code)})"

    def __reduce__(self):  # survive pickling across multiprocessing
        return (GpuError, (int(self.code), self.detail))

    @property
    def gpu_lost(self) -> bool:
        return self.code in (NvmlCode.GPU_IS_LOST, NvmlCode.GPU_NOT_FOUND)

    @property
    def in_use(self) -> bool:
        return self.code is NvmlCode.IN_USE

    @property
    def not_supported(self) -> bool:
        return self.code is NvmlCode.NOT_SUPPORTED
