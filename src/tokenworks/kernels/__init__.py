"""The C kernels: built on first use, entered through one door (backend.CKernels).

build.py builds and loads csrc/; abi.py is its calling convention; products.py,
attention.py and forward.py are the products, the attention and the Llama forward paths;
batch.py lays a flat batch out for them; backend.py decides once per engine whether they
run and takes the batches they can. Importing this package loads none of them (nor torch):
a process that only reads configs, as the server's API process does, never pays for them.
"""

from tokenworks.lazy import lazy_names

KERNELS = ("auto", "c", "torch")  # which code computes a batch: EngineConfig.kernels


__getattr__ = lazy_names(
    __name__,
    {
        "CKernels": "tokenworks.kernels.backend",
        "KernelsUnavailableError": "tokenworks.kernels.backend",
    },
)

__all__ = ["KERNELS", "CKernels", "KernelsUnavailableError"]
