"""Command-line front end. Holds no logic: translates to and from the core."""
