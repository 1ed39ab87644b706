"""The consolidated NVIDIA driver volume ``nvidia_<driver version>`` (bin/, lib/, lib64/).

    catalog.py    the driver's user-space files that may go in (data)
    ldcache.py    glibc's ld.so.cache, both formats (read only)
    elf.py        class, machine, SONAME, DT_NEEDED of a shared object
    discover.py   a driver root's files found and inspected (the discovery edge)
    plan.py       discovery -> one volume's contents (pure)
    build.py      a plan -> ``<volume root>/nvidia_<version>/`` (the filesystem edge)
    manifest.py   a built volume's manifest (pure)
    manager.py    which volume a container gets across driver upgrades, and when old ones go
    mounts.py     which mount holds a path; the tmpfs mount edge
    inject.py     whether a container with an image gets the volume, with which mount (pure)
    errors.py     the package's own errors

Importable on its own: it depends on nothing in ``isolator``.
"""
