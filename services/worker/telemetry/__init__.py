"""Device telemetry for the worker: per-chip temperature, power, HBM, utilisation and health.

``npu_smi`` reads Ascend NPUs through ``npu-smi info``, ``nvml`` reads CUDA GPUs through NVML, and
``device_telemetry`` polls either on a daemon thread and exports the ``meshserve:device_*`` gauges of
docs/metrics.md. Nothing here imports torch: the worker loads it before choosing a platform.
"""
