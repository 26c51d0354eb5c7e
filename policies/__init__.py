"""The shipped autocast policy tables (TOML data; see README.md in this folder)."""
