"""Mutation testing of the suites: planted bugs (`catalogue`) run by `runner`."""
