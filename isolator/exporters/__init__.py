"""What the sidecar exports for tools beside it: Prometheus metrics, dcgm-exporter job mapping, CDI."""
