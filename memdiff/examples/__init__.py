"""Example workloads for demos and end-to-end tests (they need torch)."""
