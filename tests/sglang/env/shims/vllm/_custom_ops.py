"""SGLang's rotary embedding imports this kernel on platforms it does not know, then runs its native path.

Raising on a call keeps the shim honest: a test that reached a vLLM kernel fails instead of computing
something else.
"""


def rotary_embedding(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("vllm shim: SGLang on CPU called vllm._custom_ops.rotary_embedding")
