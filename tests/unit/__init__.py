"""In-process tests over the shipped fakes and of the pure modules, one directory per layer."""
