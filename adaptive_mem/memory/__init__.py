"""Out-of-memory rescue: the SwapManager and the allocator hooks that call it."""
