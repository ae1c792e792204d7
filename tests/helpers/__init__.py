"""Reference helpers shared by the tests (and the benchmarks): not shipped with the package."""
