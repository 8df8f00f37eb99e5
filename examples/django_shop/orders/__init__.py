"""The shop's one app: orders, and the events they raise."""
