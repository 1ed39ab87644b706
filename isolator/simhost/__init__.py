"""The simulated GPU host: real everywhere except the GPU itself.

A fake NVML library that the real pynvml loads, device nodes made with mknod, and a driver
installation with a real ld.so.cache. Used by tests, ``make demo`` and ``serve --simulate``.
"""
