"""Developer scripts; a package so that tests can import scripts.reference."""
