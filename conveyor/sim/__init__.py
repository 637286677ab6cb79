"""Discrete-event simulator: the real engine, scheduler and KV manager on a virtual clock, with a
runner that computes no tensors and returns each step's duration from a cost model (no torch)."""
