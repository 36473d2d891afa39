"""Front ends over HTTP: the API (app.py) and its bearer tokens (tokens.py)."""
