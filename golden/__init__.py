"""Golden outputs per op x implementation x hardware family (see `golden.golden`)."""
