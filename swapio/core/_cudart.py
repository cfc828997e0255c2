"""The CUDA runtime library torch loaded, reached through ctypes for the one call torch does not expose:
resetting the per-thread last error after a failed call swapio handled (cudaHostRegister). Its own module so
that pinned (which registers blocks) and cuda_copy (which copies from them) both use it without a cycle."""
def clear_last_error():
    """Resets CUDA's per-thread last error (after a failed runtime call whose error was handled), so that an
    unrelated later launch check does not report it. Uses the libcudart torch itself loaded."""
    lib = _cudart()
    if lib is not None:
        lib.cudaGetLastError()


_cudart_lib = []


def _cudart():
    if not _cudart_lib:
        _cudart_lib.append(_load_cudart(_mapped_libraries()))
    return _cudart_lib[0]


def _mapped_libraries(maps_path="/proc/self/maps"):
    try:
        with open(maps_path) as f:
            return [line.split()[-1] for line in f if "/" in line]
    except OSError:
        return []


def find_cudart(paths):
    """The path of the libcudart shared object among mapped file paths, or None (static or no CUDA runtime)."""
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if name.startswith("libcudart.so") or name.startswith("libcudart-") and ".so" in name:
            return path
    return None


def _load_cudart(paths):
    import ctypes
    path = find_cudart(paths)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded by torch: this returns the same instance
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None
