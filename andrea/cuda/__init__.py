"""Stage 1, cuda: the project's attention kernels (kernels/microgpt_cuda.cu) at run time.

launch (the launch table, tiles, NVRTC options; no torch), attention (the CuPy RawModule
backend and its autograd op), emulator (the same kernel source built with g++ for the CPU, so
the kernels are checked without a GPU), nvrtc (libnvrtc through ctypes for the compile gates and
the kernel tuner).

May import: andrea.errors, andrea.resources. Not the model: the model calls in, not out.
"""
