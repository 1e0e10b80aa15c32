"""The reference engine: SGLang's native HTTP API (the subset the trainer uses) served over HF
transformers, so local runs and tests drive the same trainer code as SGLang clusters do.

    python -m kuberl_rollout.reference --model-path DIR --host H --port P [--seed S]
        [--device cpu|cuda] [--dtype float32|bfloat16|float16]

Modules: `sampling` (SGLang's sampling params, logprob semantics, stop rules), `engine` (the
model: the running batch stepped a token at a time, weights by HF name), `kv_batch` (the
running batch's left-padded KV cache: rows join and leave), `batcher` (continuous batching:
requests join the running batch at the next step), `update_gate` (weight updates wait for the
requests in flight, as SGLang's), `weights` (weight-sync receive), `server` (aiohttp routes),
`lora` (--enable-lora: PEFT adapters applied per batch row) and `lora_service` (SGLang's
/load_lora_adapter, /unload_lora_adapter and lora_path rules).
With `--is-embedding` (a reward model): `classifier` (a *ForSequenceClassification scored at
the last token, as SGLang's) and `classify_server` (/classify and the routes around it).
"""
