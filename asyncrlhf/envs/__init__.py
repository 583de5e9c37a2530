"""Multi-turn environments and tools: the episode's interface (`Env`), the ecosystem's environments behind it
(verifiers, OpenEnv, MCP tools, Python functions, your own class), and the tool-call convention the episodes
and the OpenAI API share (`toolcalls`)."""
