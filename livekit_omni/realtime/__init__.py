"""The OpenAI Realtime dialect (GA, WebSocket): a second projection of the engine's sessions beside the Live one."""
