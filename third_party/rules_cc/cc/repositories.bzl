"""Our stand-in for rules_cc's dependency setup: nothing to fetch."""

def rules_cc_dependencies():
    pass

def rules_cc_toolchains():
    pass
