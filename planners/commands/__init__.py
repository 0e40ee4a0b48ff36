"""Sub-commands of the ``hostmem`` command line, one module each."""
