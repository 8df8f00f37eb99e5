"""The Django shop's project package (settings)."""
