"""The one door to NVML: the only module that imports pynvml.

``call`` runs one NVML function, named as in the NVML API, and maps its failure to
``errors.NvmlError`` (NVML's return code in ``nvml_code``, the function in ``call``), once for the
whole sidecar; callers that expect a failure tell it apart by that code (``absent``: the feature is
not there). ``load_library`` chooses which libnvidia-ml pynvml uses. The inventory
(isolator/gpu/nvml.py) and the health watch (isolator/gpu/health.py) reach NVML only through here.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pynvml

from isolator.errors import NvmlError, NvmlNotFound

DEFAULT_LIBRARY = "libnvidia-ml.so.1"

# nvmlReturn_t values that callers tell apart.
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND  # the driver is older than the function
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST

# NVML's constants, by the names the inventory and the health watch use.
FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
NVLINK_DEVICE_TYPE_GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
NVLINK_DEVICE_TYPE_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
CLOCK_GRAPHICS = pynvml.NVML_CLOCK_GRAPHICS
CLOCK_MEM = pynvml.NVML_CLOCK_MEM
MEMORY_V2 = pynvml.nvmlMemory_v2
EVENT_XID = pynvml.nvmlEventTypeXidCriticalError
EVENT_DOUBLE_BIT_ECC = pynvml.nvmlEventTypeDoubleBitEccError
EVENT_SINGLE_BIT_ECC = pynvml.nvmlEventTypeSingleBitEccError


def call(function: str, *args: Any, op: str = "", target: str = "NVML", **kwargs: Any) -> Any:
    """``pynvml.<function>(*args, **kwargs)``; a failure is ``NvmlError`` ("failed to <op> '<target>':
    <NVML's text>"; ``op`` defaults to calling the function)."""
    fn = getattr(pynvml, function)
    try:
        return fn(*args, **kwargs)
    except pynvml.NVMLError as exc:
        raise NvmlError(
            op=op or f"call {function}", target=target, cause=str(exc), nvml_code=exc.value, call=function
        ) from exc


def code(exc: NvmlError) -> int | None:
    """NVML's return code of a failed ``call`` (None for an error raised elsewhere)."""
    value = exc.fields.get("nvml_code")
    return value if isinstance(value, int) else None


def absent(exc: NvmlError) -> bool:
    """The failure says the feature is not there (not supported by the GPU, or by the driver)."""
    return code(exc) in (NOT_SUPPORTED, FUNCTION_NOT_FOUND)


def cause(exc: NvmlError) -> str:
    """NVML's own text for a failed ``call`` (what pynvml's exception says)."""
    return str(exc.fields.get("cause", exc.message))


def error_name(exc: NvmlError) -> str:
    """The return code's name for the codes an operator acts on, else "NVML error <n>"."""
    return {
        NO_PERMISSION: "NO_PERMISSION",
        NOT_SUPPORTED: "NOT_SUPPORTED",
        FUNCTION_NOT_FOUND: "FUNCTION_NOT_FOUND",
        GPU_IS_LOST: "GPU_IS_LOST",
    }.get(code(exc) or 0, f"NVML error {code(exc)}")


# ---- loading --------------------------------------------------------------------------------

_load_lock = threading.Lock()
_loaded_path: str | None = None


def load_library(path: str = "") -> None:
    """Make pynvml use NVML from ``path`` (or, when empty, wherever the dynamic loader finds it).

    pynvml keeps one module-wide library handle (``pynvml.nvmlLib``) that nvmlInit fills with
    ``CDLL("libnvidia-ml.so.1")`` when it is None; assigning our own CDLL first is how a library in
    an odd place (or the simulated host's) is used. Its function-pointer cache must go with it.
    """
    global _loaded_path
    with _load_lock:
        if path:
            if _loaded_path == path and pynvml.nvmlLib is not None:
                return
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                raise NvmlNotFound(target=path, cause=str(exc)) from exc
            with pynvml.libLoadLock:
                pynvml.nvmlLib = lib
                pynvml._nvmlGetFunctionPointer_cache.clear()
            _loaded_path = path
        elif _loaded_path is not None:
            with pynvml.libLoadLock:
                pynvml.nvmlLib = None
                pynvml._nvmlGetFunctionPointer_cache.clear()
            _loaded_path = None


def init(target: str) -> None:
    """nvmlInit (nvidia-smi fails the same way when it does); ``NvmlNotFound`` naming ``target``."""
    try:
        call("nvmlInit")
    except NvmlError as exc:
        why = "not found by the dynamic loader" if code(exc) == LIBRARY_NOT_FOUND else cause(exc)
        raise NvmlNotFound(target=target, cause=why) from exc
