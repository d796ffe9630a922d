"""Continuous-integration scripts and the mutation session (`ci.mutants`)."""
