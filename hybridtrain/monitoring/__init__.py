"""Watching a training run: Prometheus metrics served by the job, and DeepSpeed's
TensorBoard / CSV / W&B monitors and MLflow.

- :mod:`~hybridtrain.monitoring.metric_names`: the exposed names (the dashboards' contract).
- :mod:`~hybridtrain.monitoring.prometheus`: the ``/metrics`` endpoint of one rank.
- :mod:`~hybridtrain.monitoring.monitors`: TensorBoard, CSV and W&B writers.
- :mod:`~hybridtrain.monitoring.mlflow_monitor`: MLflow tracking (params, ``config.json``, metrics by step).
- :mod:`~hybridtrain.monitoring.readings`: memory, FLOPs per token, device peaks.
- :mod:`~hybridtrain.monitoring.telemetry`: how ``hybridtrain train`` wires them.

Every destination shows the numbers of the ``metrics.jsonl`` record of the same step.
"""

from hybridtrain.monitoring.metric_names import METRICS

__all__ = ["METRICS"]
