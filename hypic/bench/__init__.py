"""Load generation against OpenAI-compatible servers: `hypic bench serve` (see docs/bench-serve.md)."""
