"""Structured outputs, in one package: what a constrained request asks for and the masks a step
applies (spec.py, plain data that crosses to Ray workers), applying them to the logits
(masking.py), grammars compiled with llguidance (grammar.py) and the engine's per-request matchers
(matchers.py). Import the module you need: this package imports nothing, so reading a request's
spec never loads the grammar library."""
