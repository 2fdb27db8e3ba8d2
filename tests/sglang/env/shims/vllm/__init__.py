"""Import shim for SGLang on CPU: only ``vllm._custom_ops.rotary_embedding`` is named, never called."""
