"""The I/O core as Python sees it: handles and futures over swapio._C, pinned memory, CUDA staging copies,
swap-directory ownership, durable commits, checksums, errors. Public names are re-exported by swapio."""
