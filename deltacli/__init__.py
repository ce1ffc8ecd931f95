"""deltazip command-line interface: parsing and rendering only, no algorithms."""
