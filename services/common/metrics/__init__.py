"""Prometheus metrics shared by every service: names, exposition, the /metrics server, gRPC server metrics."""
