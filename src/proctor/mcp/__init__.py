"""The MCP server (docs/agents.md): Proctor's write-run-approve loop as tools a coding
agent calls over the Model Context Protocol, each one an API operation made through
the SDK as the agent's principal, so it decides and records nothing itself."""
