"""The C kernels: built on first use, entered through one door (backend.CKernels).

build.py builds and loads csrc/; abi.py is its calling convention; products.py,
attention.py and forward.py are the products, the attention and the Llama forward paths;
batch.py lays a flat batch out for them; backend.py decides once per engine whether they
run and takes the batches they can.
"""

from tokenworks.kernels.backend import KERNELS, CKernels, KernelsUnavailableError

__all__ = ["KERNELS", "CKernels", "KernelsUnavailableError"]
