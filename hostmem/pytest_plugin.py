"""pytest plugin of hostmem (registered through the pytest11 entry point)."""
