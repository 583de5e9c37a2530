"""Multi-turn environments and tools: the episode's interface (`Env`) and the ecosystem's environments behind
it (verifiers, OpenEnv, MCP tools, Python functions, your own class). The tool-call convention the episodes
and the OpenAI API share is the chat format's (`asyncrlhf.chat_format`)."""
