"""Serving benchmarks: seeded synthetic workloads (`workloads`) and the wall-clock harness that drives the
engine through them and measures latency per output token (`serving`)."""
