"""The consolidated NVIDIA driver volume ``nvidia_<driver version>`` (bin/, lib/, lib64/).

Importable on its own: it depends on nothing in ``isolator``.
"""
