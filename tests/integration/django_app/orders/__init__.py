"""The test project's one app: ``Order``."""
