"""The simulated GPU host: real everywhere except the GPU itself.

    sim.py         one simulated host under a root directory: the fake NVML, its state, /proc, /dev
    host.py        host descriptions (TOML): parse, validate, render the fake's state
    devnodes.py    character device nodes made with mknod under a dev root
    driver.py      a driver installation: real ELF files and a real ld.so.cache
    mpscontrol.py  a stand-in ``nvidia-cuda-mps-control`` (servers as real processes, clients by socket)
    mpsmodel.py    what an MPS control daemon knows and answers (shared with testing.FakeMps)
    mpsclient.py   a stand-in MPS client: prints the limits CUDA would give it

The fake NVML library itself is fakenvml.c, which the real pynvml loads. Used by tests, ``make
demo`` and ``serve --simulate``.
"""
