"""A small MCP server over stdio for the tests: a lookup table and a tool that always fails."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("lookup")
CAPITALS = {"france": "Paris", "japan": "Tokyo"}


@server.tool()
def capital(country: str) -> str:
    """The capital city of a country."""
    return CAPITALS[country.lower()]


@server.tool()
def broken(x: int) -> str:
    """Always fails."""
    raise ValueError("the backend is down")


if __name__ == "__main__":
    server.run()
