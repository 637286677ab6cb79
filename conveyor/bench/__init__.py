"""Benchmarks: seeded workloads, vLLM-compatible serving metrics, an in-process policy comparison
(`conveyor bench compare`) and a load client for OpenAI-compatible servers (`conveyor bench serve`)."""
