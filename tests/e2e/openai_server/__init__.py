"""End-to-end tests of the OpenAI-compatible server on one shared local Ray + Serve deployment."""
