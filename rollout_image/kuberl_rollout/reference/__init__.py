"""The reference engine: SGLang's native HTTP API (the subset the trainer uses) served over HF
transformers, so local runs and tests drive the same trainer code as SGLang clusters do.

    python -m kuberl_rollout.reference --model-path DIR --host H --port P [--seed S]
        [--device cpu|cuda] [--dtype float32|bfloat16|float16]

Modules: `sampling` (SGLang's sampling params, logprob semantics, stop rules), `engine` (the
model: batched KV-cached decoding, weights by HF name), `batcher` (concurrent requests into
batches), `weights` (weight-sync receive), `server` (aiohttp routes).
"""
