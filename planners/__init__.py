def __getattr__(name):  # planners.execute, imported when first used: the command line never loads torch for it
    if name == "execute":
        from .executor import execute
        return execute
    raise AttributeError(f"module 'planners' has no attribute {name!r}")
