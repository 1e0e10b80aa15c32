"""The megatron backend's parts (issue 6). Pure modules here import only torch; anything that
needs megatron-core imports it lazily, so CPU CI tests the pure parts without it."""
