"""A stand-in for sgl-kernel, which has CUDA wheels only: SGLang's CPU engine imports names from it that it never
calls on CPU. Any name is a function that raises if called."""
__version__ = "0.0.0"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is CUDA-only (this is posttrain's CPU stand-in)")
    missing.__name__ = name
    return missing
