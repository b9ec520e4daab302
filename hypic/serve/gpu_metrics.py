"""GPU memory and utilisation gauges through NVML (nvidia-ml-py), read at scrape time.

Only built when the engine runs on CUDA; `pynvml` is imported then and only then.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class GpuCollector(Collector):
    def __init__(self, device: str) -> None:
        self._index = _device_index(device)
        self._nvml = _load_nvml()
        self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self._index) if self._nvml else None

    def collect(self) -> Iterator[Metric]:
        if self._handle is None:
            return
        memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        labels = [str(self._index)]
        yield _gauge("hypic_gpu_memory_used_bytes", "GPU memory in use (all processes)", labels, memory.used)
        yield _gauge("hypic_gpu_memory_total_bytes", "GPU memory", labels, memory.total)
        yield _gauge("hypic_gpu_utilization_ratio", "Fraction of time a kernel ran (last sample)", labels, rates.gpu / 100)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _gauge(name: str, documentation: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["gpu"])
    family.add_metric(labels, float(value))
    return family


def _device_index(device: str) -> int:
    """NVML's index of the torch device: 'cuda:N' counts CUDA_VISIBLE_DEVICES entries, NVML does not."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return int(visible[index]) if index < len(visible) and visible[index].isdigit() else index


def _load_nvml():  # -> the initialised pynvml module, or None when NVML is unavailable
    try:
        import pynvml

        pynvml.nvmlInit()
    except ImportError:
        log.warning("GPU metrics are off: install nvidia-ml-py (pip install 'hypic[gpu]')")
        return None
    except Exception as error:  # pynvml.NVMLError: driver library missing or too old
        log.warning("GPU metrics are off: NVML failed to start (%s)", error)
        return None
    return pynvml
