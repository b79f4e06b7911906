"""The OpenAI Live facade: a thin translator between Live wire events and engine commands/events."""
