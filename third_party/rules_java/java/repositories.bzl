"""Our stand-in for rules_java's dependency setup: nothing to fetch."""

def rules_java_dependencies():
    pass

def rules_java_toolchains():
    pass
