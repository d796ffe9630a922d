"""tokamax test suites: per-hardware matrices and the tests that expand them."""
