"""The session core every way in is built on (docs/architecture.md, The serving side)."""
