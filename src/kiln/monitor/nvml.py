"""GPU readings through NVML (`nvidia-ml-py`, the `gpu` extra), imported lazily.

NVML reads counters the driver keeps; it never touches the CUDA stream, so sampling from a
background thread costs the training loop nothing (no host sync).
"""

from __future__ import annotations

from typing import Any

# clock event reasons (nvml.h): the GPU slows itself down
THERMAL = 0x20 | 0x40  # software and hardware thermal slowdown
POWER = 0x04 | 0x80  # software power cap, hardware power brake


class NvmlReader:
    """Readings of one GPU. `nvml` is the pynvml module (tests pass a stand-in)."""

    def __init__(self, index: int = 0, uuid: str | None = None, nvml: Any = None):
        if nvml is None:
            import pynvml as nvml  # the gpu extra: pip install 'kiln[gpu]'
        self.nvml = nvml
        nvml.nvmlInit()
        handle = None
        if uuid:  # CUDA_VISIBLE_DEVICES renumbers devices; the UUID names this one
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # noqa: BLE001 - fall back to the index
                handle = None
        self.handle = handle if handle is not None else nvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> dict[str, float]:
        n, h = self.nvml, self.handle
        mem = n.nvmlDeviceGetMemoryInfo(h)
        out = {"gpu_util": float(n.nvmlDeviceGetUtilizationRates(h).gpu),
               "gpu_mem_used_gib": mem.used / 2**30, "gpu_mem_frac": mem.used / max(mem.total, 1)}
        for key, read in (("gpu_power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                          ("gpu_temp_c", lambda: float(n.nvmlDeviceGetTemperature(h, 0))),  # NVML_TEMPERATURE_GPU
                          ("gpu_sm_clock_mhz", lambda: float(n.nvmlDeviceGetClockInfo(h, 1)))):  # NVML_CLOCK_SM
            try:
                out[key] = read()
            except Exception:  # noqa: BLE001 - not every board reports every counter
                pass
        try:
            reasons = n.nvmlDeviceGetCurrentClocksEventReasons(h)
        except Exception:  # noqa: BLE001 - older drivers: the deprecated name
            try:
                reasons = n.nvmlDeviceGetCurrentClocksThrottleReasons(h)
            except Exception:  # noqa: BLE001
                reasons = None
        if reasons is not None:
            out["gpu_throttle_thermal"] = float(bool(reasons & THERMAL))
            out["gpu_throttle_power"] = float(bool(reasons & POWER))
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
