"""Front ends over HTTP: the API (app.py and its routes), MCP (mcp_server.py), tokens, the playground."""
