"""Inference, the second product: `fast_generate` and `FastModel`.

api.py          fast_generate, graph_status: inputs, buckets, the per-model decoder
plan.py         the model's weights as the decoder reads them (projections with unmerged LoRA, norms, MLP)
decoder.py      the KV cache and decode state, the per-op forward, the decode step and its CUDA graph
fast_decode.py  the decode step through fastplug.kernels.decode
sampling.py     greedy and seeded sampling without RNG state
fast_model.py   FastModel: load, add LoRA, switch between training and inference
"""
