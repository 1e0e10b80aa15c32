"""The megatron backend (backend.py) and its parts: the model built from an HF config
(model.py), the HF <-> Megatron weight layout (hf_layout.py), export in HF names for weight
sync (export.py), SDPA core attention, the grad norm. Pure modules here import only torch;
anything that needs megatron-core imports it lazily, so CPU CI tests the pure parts without
it."""
