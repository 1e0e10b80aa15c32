"""Training backends behind one interface (base.py, docs/trainer-contracts.md): `fsdp` (HF
transformers + torch DDP/FSDP2) and `megatron` (megatron-core, in megatron/); factory.py
picks one for a job. The rest are the parts both share: micro-batches and packing, optimizer
and offload, log-probs over the vocabulary, weight buckets, HF files, RNG state."""
