"""Benchmarks: `python -m fastplug.bench micro` (single ops) and `python -m fastplug.bench e2e` (training
steps of whole models), each against plain transformers/torch, torch.compile and Liger-Kernel when installed.
"""
