"""Our stand-in for rules_java: Bazel 4.2.3's java rules are native."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_test = native.java_test
java_plugin = native.java_plugin
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
java_package_configuration = native.java_package_configuration
