"""Seeded synthetic serving workloads (`workloads`): what `tune` profiles and the serving benchmarks
(`benchmarks/serving_harness.py`) run."""
